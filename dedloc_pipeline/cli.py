"""``dedloc``: the command line of organizers and volunteers."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import traceback
from enum import Enum
from typing import Optional

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from .protocol.config import CloseRule, recipe_config
from .trust import identity
from .model.data import DataError
from .trust.identity import IdentityError
from .protocol.run import Run, RunError, init_run
from .storage.bucket import Bucket, StorageError


# click's exceptions, wherever this typer takes click from (recent typers vendor it)
_cx = importlib.import_module(typer.BadParameter.__module__)
_PASS = tuple({typer.Exit, typer.Abort, *(getattr(_cx, n) for n in ("Exit", "Abort", "NoArgsIsHelpError")
                                          if hasattr(_cx, n))})


class _Group(TyperGroup):
    """Every failure ends in one line on stderr, ``error: ...``, and a non-zero exit status.

    Usage errors (a bad flag value, a missing option) come from click, which would otherwise draw
    a multi-line panel; anything the commands did not anticipate (a botocore error, a bug) would
    otherwise print only a traceback. The traceback is still shown first when logging is verbose.
    """

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except _PASS:
            raise
        except _cx.ClickException as exc:
            msg = _one_line(exc.format_message()).replace("Value error, ", "")
            sub = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else ctx.command_path
            if isinstance(exc, _cx.UsageError):
                msg += f" (see '{sub} --help')"
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(exc.exit_code or 2)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            if logging.getLogger().isEnabledFor(logging.INFO):
                traceback.print_exc()
            typer.echo(f"error: {type(exc).__name__}: {_one_line(str(exc))}", err=True)
            raise typer.Exit(1)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  help="Volunteer pretraining through an object-storage bucket.")


class CodecName(str, Enum):
    none = "none"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"


class Aggregation(str, Enum):
    mean = "mean"
    trimmed_mean = "trimmed_mean"
    centered_clip = "centered_clip"


class OptimizerName(str, Enum):
    adamw = "adamw"
    lamb = "lamb"


BucketOpt = typer.Option(..., "--bucket", help="fsspec URL: a path, file://, s3://bucket/prefix, memory://")
RunOpt = typer.Option(..., "--run", help="run name inside the bucket")
EndpointOpt = typer.Option(None, "--endpoint-url", envvar="AWS_ENDPOINT_URL",
                           help="S3 endpoint (MinIO, R2); credentials come from the usual AWS variables")


def _setup(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# config fields as the flags of `dedloc init` spell them
_FLAGS = {"run": "--run", "preset": "--preset", "seed": "--seed", "seq_len": "--seq-len",
          "target_batch_size": "--target-batch", "micro_batch": "--micro-batch", "codec": "--codec",
          "chunk_size": "--chunk-size", "block_size": "--chunk-size", "chunks_per_part": "--chunks-per-part",
          "peer_timeout_s": "--peer-timeout", "lr": "--lr", "timeout_s": "--close-timeout",
          "min_fraction": "--min-fraction", "late_shards": "--late-shards", "aggregation": "--aggregation",
          "organizer_key": "--organizer-key"}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            loc = [str(x) for x in e.get("loc", ())]
            where = _FLAGS.get(loc[-1], ".".join(loc)) if loc else ""
            msg = e.get("msg", "invalid").removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        return "invalid value: " + "; ".join(parts)
    text = _one_line(str(exc))
    return text or type(exc).__name__


def _fail(exc: BaseException) -> None:
    typer.echo(f"error: {_describe(exc)}", err=True)
    raise typer.Exit(2)


def _open(bucket: str, run: str, endpoint: str | None) -> Run:
    return Run(Bucket(bucket, endpoint_url=endpoint), run)


_ERRORS = (RunError, DataError, StorageError, IdentityError, ValueError, ValidationError, FileNotFoundError, PermissionError)


@app.command()
def init(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         preset: str = typer.Option("tiny", help="tiny | small | sahajbert (sets its recipe's defaults)"),
         target_batch: Optional[int] = typer.Option(None, "--target-batch", help="default: the preset's (tiny 256)"),
         data: str = typer.Option("synthetic", help="a data set in the bucket (the tokenize flow writes one)"),
         micro_batch: int = 8, codec: CodecName = CodecName.int8,
         download_codec: Optional[CodecName] = typer.Option(
             None, help="parameter deltas peers download (default: int4 for int8 shards, else the codec)"),
         optimizer: Optional[OptimizerName] = typer.Option(None, help="default: the preset's (tiny adamw)"),
         lr: Optional[float] = typer.Option(None, help="default: the preset's (tiny 2e-3)"), seed: int = 0,
         seq_len: Optional[int] = None, chunk_size: int = 1 << 20, chunks_per_part: int = 1,
         close_timeout: Optional[float] = typer.Option(None, help="close a short round after SECONDS"),
         min_fraction: float = typer.Option(0.5, help="... if this share of the target is in"),
         late_shards: str = typer.Option("reject", help="reject | fold (count in the next round)"),
         delayed_updates: bool = typer.Option(True, help="keep computing while a round is reduced"),
         peer_timeout: float = typer.Option(20.0, help="seconds before a silent peer counts as gone"),
         organizer_key: Optional[str] = typer.Option(
             None, help="your private key (`dedloc keygen`): admit only shards of volunteers you enrol"),
         aggregation: Aggregation = typer.Option(
             Aggregation.mean, help="mean (exact) | trimmed_mean | centered_clip (robust to byzantine peers)"),
         verbose: bool = False):
    """Create a run in the bucket and commit state 0."""
    _setup(verbose)
    try:
        org = identity.public(identity.load(organizer_key)) if organizer_key else None
        cfg = recipe_config(run, preset, data=data, seed=seed, seq_len=seq_len, target_batch_size=target_batch,
                            micro_batch=micro_batch, codec=codec.value, chunk_size=chunk_size,
                            download_codec=download_codec.value if download_codec else None,
                            block_size=min(4096, chunk_size), chunks_per_part=chunks_per_part,
                            delayed_updates=delayed_updates, peer_timeout_s=peer_timeout, organizer_key=org,
                            aggregation=aggregation.value,
                            optimizer={"name": optimizer.value if optimizer else None, "lr": lr},
                            close=CloseRule(timeout_s=close_timeout, min_fraction=min_fraction,
                                            late_shards=late_shards))
        r = init_run(Bucket(bucket, endpoint_url=endpoint_url), cfg)
        typer.echo(f"run {run} ready in {bucket}: {r.flat.n:,} parameters, state 0 committed")
    except _ERRORS as exc:
        _fail(exc)


@app.command()
def worker(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           peer_id: Optional[str] = typer.Option(None, help="stable id (default: random)"),
           until_round: Optional[int] = typer.Option(None, help="exit once state R is committed"),
           threads: Optional[int] = typer.Option(None, help="torch threads"),
           micro_batch: Optional[int] = typer.Option(None, help="this volunteer's micro-batch"),
           poll: float = typer.Option(1.0, help="seconds between bucket polls"),
           device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available, else cpu)"),
           key: Optional[str] = typer.Option(None, envvar="DEDLOC_KEY",
                                             help="your private key: signs your shards (runs that require it)"),
           plain: bool = typer.Option(False, "--plain", help="plain progress lines, even in a terminal"),
           progress_every: float = typer.Option(10.0, help="seconds between plain progress lines"),
           verbose: bool = True):
    """Join a run as a volunteer: compute gradients and upload shards, with a live progress display.

    Ctrl-C finishes an upload under way, leaves, and prints what you contributed (exit status
    130); a second Ctrl-C quits at once."""
    _setup(verbose)
    from .monitoring.progress import make_worker, summary_text, volunteer
    try:
        w = make_worker(bucket, run, peer_id, key, device, micro_batch, threads, poll, endpoint_url)
        s = volunteer(w, until_round, plain=plain or None, every=progress_every)
    except _ERRORS as exc:
        _fail(exc)
    except KeyboardInterrupt:
        raise typer.Exit(130)
    typer.echo(summary_text(s))
    if s["ended"] in ("ctrl_c", "interrupted"):
        raise typer.Exit(130)


@app.command()
def aggregate(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
              until_round: Optional[int] = typer.Option(None, help="exit once state R is committed"),
              parallel: int = typer.Option(2, help="aggregator threads"),
              poll: float = typer.Option(1.0, help="seconds between bucket polls"),
              verbose: bool = True):
    """Schedule rounds: close, reduce, apply, commit (no Prefect needed)."""
    _setup(verbose)
    from .protocol.scheduler import Scheduler
    try:
        state = Scheduler(_open(bucket, run, endpoint_url), parallel, poll).serve(until_round)
        typer.echo(f"state {state} committed")
    except _ERRORS as exc:
        _fail(exc)
    except KeyboardInterrupt:
        raise typer.Exit(130)


@app.command()
def stop(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         reason: str = typer.Option("stopped by the organizer", help="recorded in the marker")):
    """End a run: schedulers and the pretrain flow stop after the open round."""
    _setup(False)
    import time
    try:
        r = _open(bucket, run, endpoint_url)
        r.bucket.create_json(r.keys.stop(), {"reason": reason, "at": time.time(), "state": r.latest()})
        typer.echo(f"run {run}: STOP marker written at state {r.latest()}")
    except _ERRORS as exc:
        _fail(exc)


@app.command()
def keygen(out: str = typer.Option(..., help="file for the new private key (kept secret, never overwritten)")):
    """Make a volunteer's or organizer's Ed25519 key pair; prints the public key to share."""
    try:
        pub = identity.public(identity.generate(out))
    except _ERRORS as exc:
        _fail(exc)
    typer.echo(f"private key: {out} (keep it secret)\npublic key: {pub}")


@app.command()
def enroll(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           organizer_key: str = typer.Option(..., help="the private key the run was created with"),
           volunteer: str = typer.Option(..., help="name; its peers are NAME or NAME.anything"),
           public_key: str = typer.Option(..., help="the volunteer's public key (`dedloc keygen` prints it)")):
    """Admit a volunteer's shards: add its public key to the run's signed roster."""
    roster = _change_roster(bucket, run, endpoint_url, organizer_key, enroll={volunteer: public_key})
    typer.echo(f"run {run}: {volunteer} enrolled (roster version {roster.version}, "
               f"{len(roster.volunteers)} volunteers)")


@app.command()
def revoke(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           organizer_key: str = typer.Option(..., help="the private key the run was created with"),
           volunteer: str = typer.Option(..., help="whose shards are refused from now on")):
    """Refuse a volunteer's shards from the open round on (committed rounds stay as they are)."""
    roster = _change_roster(bucket, run, endpoint_url, organizer_key, revoke=[volunteer])
    typer.echo(f"run {run}: {volunteer} revoked (roster version {roster.version})")


@app.command()
def policy(bucket: str = typer.Option(..., "--bucket", help="s3://bucket/prefix of the run"), run: str = RunOpt,
           peer: str = typer.Option(..., help="the volunteer's peer id"),
           format: str = typer.Option("aws", "--format", help="aws (IAM/STS session policy) | minio | r2"),
           data: Optional[str] = typer.Option(None, help="narrow reads to this data set"),
           ttl: int = typer.Option(86400, help="r2: seconds the temporary credentials live"),
           parent_access_key_id: Optional[str] = typer.Option(None, help="r2: the organizer's access key id")):
    """Print least-privilege rights for one volunteer: write its own prefixes, read the run (docs/security.md)."""
    from .trust.policy import policy_for
    options = {"data": data}
    if format == "r2":
        options.update(ttl_seconds=ttl, **({"parent_access_key_id": parent_access_key_id}
                                           if parent_access_key_id else {}))
    try:
        typer.echo(json.dumps(policy_for(bucket, run, peer, format, **options), indent=2))
    except _ERRORS as exc:
        _fail(exc)


def _change_roster(bucket: str, run: str, endpoint: str | None, organizer_key: str, **change):
    """Enrol or revoke in a signed run's roster, with the key the run was created with."""
    _setup(False)
    try:
        r = _open(bucket, run, endpoint)
        org = identity.load(organizer_key)
        if r.config.organizer_key is None:
            raise RunError(f"run {run!r} was created without --organizer-key: it accepts unsigned shards")
        if identity.public(org) != r.config.organizer_key:
            raise IdentityError(f"{organizer_key} is not the key run {run!r} was created with")
        return identity.update_roster(r.bucket, run, org, **change)
    except _ERRORS as exc:
        _fail(exc)


@app.command("eval")
def eval_(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
          state: Optional[int] = typer.Option(None, help="committed state (default: the latest)"),
          task: list[str] = typer.Option(["mlm-heldout", "ner", "news"], help="mlm-heldout | ner | news"),
          source: str = typer.Option("offline", help="offline (the project's stand-in sets) | hub (WikiANN-bn, Soham)"),
          corpus_dir: str = typer.Option(".dedloc/corpus", help="the offline corpus (`make corpus`)"),
          epochs: int = typer.Option(20, help="most fine-tuning epochs (early stopping ends sooner)"),
          max_train: Optional[int] = typer.Option(None, help="fine-tune on at most N training examples"),
          verbose: bool = False):
    """Score a committed state next to random init: held-out MLM loss, NER F1, news accuracy."""
    _setup(verbose)
    from .evaluation import heldout as evaluation
    try:
        r = _open(bucket, run, endpoint_url)
        state = r.latest() if state is None else state
        for name in task:
            if name == "mlm-heldout":
                res = evaluation.evaluate(r, state)
                typer.echo(f"mlm-heldout ({res['dataset']}): loss {res['loss']:.4f} "
                           f"(random init {res['random_init_loss']:.4f})")
            else:
                res = evaluation.finetune_eval(r, state, name, source, corpus_dir, epochs=epochs,
                                               max_train=max_train)
                typer.echo(f"{name} ({res['source']}): test {res['metric']} {res['pretrained']['test']:.4f} "
                           f"(random init {res['random_init']['test']:.4f})")
    except _ERRORS as exc:
        _fail(exc)


@app.command()
def export(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           out: str = typer.Option(..., help="folder for the Hugging Face model and tokenizer"),
           state: Optional[int] = typer.Option(None, help="committed state (default: the latest)")):
    """Write a committed state as a Hugging Face directory (AutoModelForMaskedLM.from_pretrained)."""
    _setup(False)
    from .evaluation.export import export as export_state
    try:
        path = export_state(_open(bucket, run, endpoint_url), state, out)
        typer.echo(f"exported to {path}")
    except _ERRORS as exc:
        _fail(exc)


@app.command()
def status(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           as_json: bool = typer.Option(False, "--json", help="one JSON object")):
    """Where a run stands: the open round and its ETA, the last rounds, the contributors."""
    _setup(False)
    from .monitoring.status import show, status as get_status
    try:
        s = get_status(_open(bucket, run, endpoint_url))
    except _ERRORS as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(s))
        return
    from rich.console import Console
    show(s, Console())


@app.command()
def plot(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         out: str = typer.Option(..., help="folder for the PNG figures")):
    """Draw the ledger as PNGs: loss, samples/s and contributors per round."""
    _setup(False)
    from .monitoring.plots import write
    from .monitoring.status import status as get_status
    try:
        paths = write(get_status(_open(bucket, run, endpoint_url))["history"], out)
    except _ERRORS as exc:
        _fail(exc)
    typer.echo("\n".join(paths))


@app.command()
def report(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           out: str = typer.Option(..., help="the HTML file to write"),
           upload: bool = typer.Option(False, help="also put it in the bucket (runs/RUN/report/index.html)")):
    """Write one self-contained HTML page of the run (figures, leaderboard, rounds, evaluations)."""
    _setup(False)
    from .monitoring.report import publish, render
    try:
        r = _open(bucket, run, endpoint_url)
        page = render(r)
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
        typer.echo(f"report written to {out}")
        if upload:
            typer.echo(f"uploaded to {publish(r, page)}")
    except _ERRORS as exc:
        _fail(exc)
