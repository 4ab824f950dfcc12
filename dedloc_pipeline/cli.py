"""``dedloc``: the command line of organizers and volunteers."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import traceback
from typing import Optional

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from .init_options import config_args, describe, one_line, with_settings
from .model.data import DataError
from .model.presets import PRESETS
from .monitoring import stop as signals
from .protocol.config import recipe_config
from .protocol.run import ORGANIZER_KEY_ENV, Run, RunError, init_run
from .storage.bucket import Bucket, Damaged, StorageError
from .trust import identity
from .trust.identity import IdentityError

# click's exceptions, wherever this typer takes click from (recent typers vendor it)
_cx = importlib.import_module(typer.BadParameter.__module__)
_PASS = tuple({typer.Exit, typer.Abort, *(getattr(_cx, n) for n in ("Exit", "Abort", "NoArgsIsHelpError")
                                          if hasattr(_cx, n))})
# what a user can fix: a bad value, a missing run, file or key, a bucket refusing access
_ERRORS = (RunError, DataError, StorageError, IdentityError, ValueError, ValidationError, FileNotFoundError,
           PermissionError)


class _Group(TyperGroup):
    """Every failure ends in one line on stderr, ``error: ...``, and a non-zero exit status.

    The commands raise; this is the one place that says how. What the user can fix (``_ERRORS``)
    and usage errors exit 2; usage errors come from click, which would otherwise draw a multi-line
    panel. Anything the commands did not anticipate (a botocore error, a bug), which would
    otherwise print only a traceback, exits 1 with its type; the traceback is still shown first
    when logging is verbose. Ctrl-C exits 130, quietly; SIGTERM and SIGHUP are taken as Ctrl-C
    (every command cleans up after them as after it) and exit 143 and 129.
    """

    def invoke(self, ctx):
        signals.as_interrupt()
        try:
            return super().invoke(ctx)
        except _PASS:
            raise
        except _cx.ClickException as exc:
            msg = one_line(exc.format_message()).replace("Value error, ", "")
            sub = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else ctx.command_path
            if isinstance(exc, _cx.UsageError):
                msg += f" (see '{sub} --help')"
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(exc.exit_code or 2)
        except Damaged as exc:  # a record `dedloc repair` sees says so: the way back
            from .organizer.repair import advice
            typer.echo(f"error: {describe(exc)}{advice(exc.key)}", err=True)
            raise typer.Exit(2)
        except _ERRORS as exc:
            typer.echo(f"error: {describe(exc)}", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt as exc:
            raise typer.Exit(signals.exit_status(exc))
        except Exception as exc:
            if logging.getLogger().isEnabledFor(logging.INFO):
                traceback.print_exc()
            typer.echo(f"error: {type(exc).__name__}: {one_line(str(exc))}", err=True)
            raise typer.Exit(1)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  help="Volunteer pretraining through an object-storage bucket.")

BucketOpt = typer.Option(..., "--bucket", help="fsspec URL: a path, file://, s3://bucket/prefix, memory://")
RunOpt = typer.Option(..., "--run", help="run name inside the bucket")
EndpointOpt = typer.Option(None, "--endpoint-url", envvar="AWS_ENDPOINT_URL",
                           help="S3 endpoint (MinIO, R2); credentials come from the usual AWS variables")


def _setup(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _organizer_key(signs: str):
    """The ``--organizer-key`` option of a command that writes organizer records (``signs``)."""
    return typer.Option(None, envvar=ORGANIZER_KEY_ENV, metavar="FILE",
                        help=f"the organizer's private key: signs {signs} (signed runs)")


def _open(bucket: str, run: str, endpoint: str | None, organizer_key: str | None = None) -> Run:
    return Run(Bucket(bucket, endpoint_url=endpoint), run,
               organizer=identity.load(organizer_key) if organizer_key else None)


@app.command()
@with_settings
def init(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         verbose: bool = False, **settings):
    """Create a run in the bucket and commit state 0."""
    _setup(verbose)
    organizer = identity.load(settings["organizer_key"]) if settings.get("organizer_key") else None
    r = init_run(Bucket(bucket, endpoint_url=endpoint_url), recipe_config(run, **config_args(settings)), organizer)
    typer.echo(f"run {run} ready in {bucket}: {r.flat.n:,} parameters, state 0 committed")


@app.command()
def worker(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           peer_id: Optional[str] = typer.Option(None, help="stable id (default: random)"),
           until_round: Optional[int] = typer.Option(None, help="exit once state R is committed"),
           threads: Optional[int] = typer.Option(None, help="torch threads"),
           micro_batch: Optional[int] = typer.Option(None, help="this volunteer's micro-batch"),
           poll: Optional[float] = typer.Option(None, help="fixed seconds between polls (default: the run's "
                                                "cadence, often near the target, seldom far from it)"),
           device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available, else cpu)"),
           precision: str = typer.Option("fp32", help="fp32, or bf16 (diloco runs): weights, gradients and the "
                                         "inner optimizer in bfloat16, half the memory"),
           key: Optional[str] = typer.Option(None, envvar="DEDLOC_KEY",
                                             help="your private key: signs your shards (runs that require it)"),
           organizer: Optional[str] = typer.Option(
               None, envvar="DEDLOC_ORGANIZER", metavar="PUBLIC_KEY",
               help="the organizer's public key, as they gave it with the bucket and run (default: the one "
                    "run.json names, pinned on first join)"),
           write_profile: Optional[str] = typer.Option(
               None, envvar="DEDLOC_WRITE_PROFILE", metavar="PROFILE",
               help="R2: the AWS profile of your write credential (read-write on your own prefix); the "
                    "usual AWS variables or profile hold the read-only one"),
           plain: bool = typer.Option(False, "--plain", help="plain progress lines, even in a terminal"),
           progress_every: float = typer.Option(10.0, help="seconds between plain progress lines"),
           aggregate: bool = typer.Option(False, "--aggregate", help="also aggregate parts of the model, if the "
                                          "organizer enrolled you to (docs/aggregators.md)"),
           verbose: bool = True):
    """Join a run as a volunteer: compute gradients and upload shards, with a live progress display.

    Ctrl-C (or SIGTERM, SIGHUP) finishes an upload under way, leaves, and prints what you
    contributed (exit status 130, 143, 129); a second one quits at once."""
    _setup(verbose)
    from .monitoring.volunteer import make_worker, summary_text, volunteer
    w = make_worker(bucket, run, peer_id, key, device, micro_batch, threads, poll, endpoint_url, precision,
                    organizer, write_profile)
    s = volunteer(w, until_round, plain=plain or None, every=progress_every, aggregate=aggregate)
    typer.echo(summary_text(s))
    if s["ended"] in ("ctrl_c", "interrupted"):
        raise typer.Exit(signals.exit_status(s["signal"]))


@app.command()
def aggregate(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
              until_round: Optional[int] = typer.Option(None, help="exit once state R is committed"),
              parallel: int = typer.Option(2, help="aggregator threads"),
              poll: Optional[float] = typer.Option(None, help="fixed seconds between polls (default: the run's "
                                                   "cadence, often near the target, seldom far from it)"),
              organizer_key: Optional[str] = _organizer_key("CLOSE, COMMIT, LATEST, streams and the round view"),
              standby: bool = typer.Option(False, help="while another scheduler holds the run's lease, wait "
                                           "and take over when it ends (default: refuse, naming it)"),
              volunteers: bool = typer.Option(False, help="give the parts to volunteer aggregators, two to a "
                                              "part, computing here what they do not settle (docs/aggregators.md)"),
              verbose: bool = True):
    """Schedule rounds: close, reduce, apply, commit (no Prefect needed)."""
    _setup(verbose)
    from .organizer.scheduler import Scheduler
    r = _open(bucket, run, endpoint_url, organizer_key)
    state = Scheduler(r, parallel, poll, volunteers=volunteers).serve(until_round, standby=standby)
    typer.echo(f"state {state} committed")


@app.command()
def aggregator(limit: int = typer.Option(2, help="task runs at once (0: no limit); each reads one part of every shard"),
               timeout: Optional[float] = typer.Option(None, help="stop after SECONDS"),
               verbose: bool = True):
    """Aggregate for an organizer's Prefect rounds from this machine: a task worker serving the
    reduce and apply tasks of `pretrain` runs with runner=task-workers (infra/README.md). Needs
    PREFECT_API_URL, the shared task storage, and the bucket's credentials."""
    _setup(verbose)
    from flows.aggregators import serve
    serve(limit=limit or None, timeout_s=timeout)


@app.command()
def stop(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         reason: str = typer.Option("stopped by the organizer", help="recorded in the marker"),
         organizer_key: Optional[str] = _organizer_key("STOP (no other STOP counts)")):
    """End a run: schedulers and the pretrain flow stop after the open round."""
    _setup(False)
    r = _open(bucket, run, endpoint_url, organizer_key)
    if not r.stop(reason):
        typer.echo(f"run {run}: already stopped")
        return
    typer.echo(f"run {run}: STOP marker written at state {r.latest()}")


@app.command()
def keygen(out: str = typer.Option(..., help="file for the new private key (kept secret, never overwritten)")):
    """Make a volunteer's or organizer's Ed25519 key pair; prints the public key to share."""
    pub = identity.public(identity.generate(out))
    typer.echo(f"private key: {out} (keep it secret)\npublic key: {pub}")


@app.command()
def enroll(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           organizer_key: str = typer.Option(..., help="the private key the run was created with"),
           volunteer: str = typer.Option(..., help="name; its peers are NAME or NAME.anything"),
           public_key: str = typer.Option(..., help="the volunteer's public key (`dedloc keygen` prints it)"),
           replace: bool = typer.Option(False, "--replace", help="give a name enrolled with another key to this "
                                        "one (the old key's shards are refused from then on)"),
           aggregate: bool = typer.Option(False, "--aggregate", help="it may also aggregate parts of the model, "
                                          "checked against another volunteer's (docs/aggregators.md)")):
    """Admit a volunteer's shards: add its public key to the run's signed roster."""
    roster = _change_roster(bucket, run, endpoint_url, organizer_key, enroll={volunteer: public_key},
                            replace=replace, aggregate=[volunteer] if aggregate else [])
    typer.echo(f"run {run}: {volunteer} enrolled{' as an aggregator too' if aggregate else ''} (roster version "
               f"{roster.version}, {len(roster.volunteers)} volunteers, {len(roster.aggregators)} aggregators)")


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
    """Print least-privilege rights for one volunteer: write its own keys, read the run (docs/security.md).
    For r2, stderr says what the credential still allows and what the protocol catches of it."""
    from .trust.policy import policy_for, r2_notice
    options = {"data": data}
    if format == "r2":
        options.update(ttl_seconds=ttl, **({"parent_access_key_id": parent_access_key_id}
                                           if parent_access_key_id else {}))
    typer.echo(json.dumps(policy_for(bucket, run, peer, format, **options), indent=2))
    if format == "r2":
        typer.echo(r2_notice(bucket, run, peer, data, ttl), err=True, nl=False)


def _change_roster(bucket: str, run: str, endpoint: str | None, organizer_key: str, **change):
    """Enrol or revoke in a signed run's roster, with the key the run was created with."""
    _setup(False)
    r = _open(bucket, run, endpoint)
    org = identity.load(organizer_key)
    if r.config.organizer_key is None:
        raise RunError(f"run {run!r} was created without --organizer-key: it accepts unsigned shards")
    if identity.public(org) != r.config.organizer_key:
        raise IdentityError(f"{organizer_key} is not the key run {run!r} was created with")
    return identity.update_roster(r.bucket, run, org, **change)


@app.command("eval")
def eval_(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
          state: Optional[int] = typer.Option(None, help="committed state (default: the latest)"),
          task: Optional[list[str]] = typer.Option(
              None, help="mlm-heldout | lm-heldout | ner | news (default: the run's held-out loss, and ner and "
              "news for an ALBERT trained on text)"),
          source: str = typer.Option("offline", help="offline (the project's stand-in sets) | hub (WikiANN-bn, Soham)"),
          corpus_dir: str = typer.Option(".dedloc/corpus", help="the offline corpus (`make corpus`)"),
          epochs: int = typer.Option(20, help="most fine-tuning epochs (early stopping ends sooner)"),
          max_train: Optional[int] = typer.Option(None, help="fine-tune on at most N training examples"),
          verbose: bool = False):
    """Score a committed state next to random init: held-out loss, NER F1, news accuracy."""
    _setup(verbose)
    from .evaluation import heldout as evaluation
    r = _open(bucket, run, endpoint_url)
    state = r.latest() if state is None else state
    for name in task or evaluation.default_tasks(r):
        if name.endswith("heldout"):
            res = evaluation.evaluate(r, state)
            typer.echo(f"{res['task']} ({res['dataset']}): loss {res['loss']:.4f}, perplexity "
                       f"{res['perplexity']:.1f} (random init {res['random_init_loss']:.4f})")
        else:
            res = evaluation.finetune_eval(r, state, name, source, corpus_dir, epochs=epochs,
                                           max_train=max_train)
            typer.echo(f"{name} ({res['source']}): test {res['metric']} {res['pretrained']['test']:.4f} "
                       f"(random init {res['random_init']['test']:.4f})")


@app.command()
def export(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           out: str = typer.Option(..., help="folder for the Hugging Face model and tokenizer"),
           state: Optional[int] = typer.Option(None, help="committed state (default: the latest)")):
    """Write a committed state as a Hugging Face directory (AutoModelForMaskedLM.from_pretrained)."""
    _setup(False)
    from .evaluation.export import export as export_state
    path = export_state(_open(bucket, run, endpoint_url), state, out)
    typer.echo(f"exported to {path}")


@app.command()
def status(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           as_json: bool = typer.Option(False, "--json", help="one JSON object")):
    """Where a run stands: the open round and its ETA, the last rounds, the contributors."""
    _setup(False)
    from .monitoring.status import show, status as get_status
    s = get_status(_open(bucket, run, endpoint_url))
    if as_json:
        typer.echo(json.dumps(s))
        return
    from rich.console import Console
    show(s, Console())


@app.command()
def repair(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           apply: bool = typer.Option(False, "--apply", help="do it: move what is damaged under runs/RUN/damaged/ "
                                      "and go back to the newest intact state (default: say what would be done)"),
           organizer_key: Optional[str] = _organizer_key("LATEST")):
    """Check the newest states against their COMMITs; repair a damaged run (exit 1: damage not repaired)."""
    _setup(False)
    from .organizer.repair import repair as repair_run
    org = identity.load(organizer_key) if organizer_key else None
    if not repair_run(Run(Bucket(bucket, endpoint_url=endpoint_url), run, organizer=org), apply, typer.echo):
        raise typer.Exit(1)


@app.command("cost")
def cost_(peers: int = typer.Option(..., help="volunteers training at once"),
          days: float = typer.Option(..., help="length of the run"),
          preset: Optional[str] = typer.Option(None, help=f"{' | '.join(PRESETS)} (default tiny; not with --bucket)"),
          samples_per_s: Optional[float] = typer.Option(
              None, "--samples-per-s", help="one volunteer's samples/s (default: the preset's measured speed)"),
          target_batch: Optional[int] = typer.Option(None, help="samples per round (default: the preset's recipe)"),
          prices: Optional[str] = typer.Option(None, help="a JSON price table replacing the built-in one "
                                               "(docs/cost.md)"),
          bucket: Optional[str] = typer.Option(None, help="read the config of --run in this bucket instead"),
          run: Optional[str] = typer.Option(None, help="with --bucket: the run whose config is priced"),
          endpoint_url: Optional[str] = EndpointOpt,
          reduce_s: Optional[float] = typer.Option(None, help="seconds from CLOSE to COMMIT (default: benchmark "
                                                   "5's fit)"),
          micro_batch: Optional[int] = typer.Option(None, help="the volunteers' micro-batch (default: the run's): "
                                                    "a worker polls and heartbeats between micro-batches"),
          uplink_mbit: float = typer.Option(20.0, help="a volunteer's upload speed, Mbit/s"),
          scheduler_poll: Optional[float] = typer.Option(None, help="the scheduler's fixed poll interval "
                                                         "(default: the run's cadence)"),
          scheduler_in_region: bool = typer.Option(False, help="the scheduler runs in the provider's region: "
                                                   "its reads are no egress"),
          aggregators: int = typer.Option(0, help="volunteer aggregators, two to a part (docs/aggregators.md); "
                                          "0: the organizer aggregates"),
          as_json: bool = typer.Option(False, "--json", help="one JSON object")):
    """Price a collaboration in dollars at S3 and R2: requests, egress and storage, per volunteer-day and for the run."""  # noqa: E501
    _setup(False)
    from .planning.display import show
    from .planning.estimate import estimate
    from .planning.prices import PRICES, load_prices
    if bucket is not None or run is not None:
        if bucket is None or run is None:
            raise ValueError("--bucket and --run go together: the run whose config is priced")
        if preset is not None or target_batch is not None:
            raise ValueError("--bucket reads the run's own config: drop --preset and --target-batch")
        config = _open(bucket, run, endpoint_url).config
    else:
        config = recipe_config("plan", preset or "tiny", target_batch_size=target_batch)
    table = load_prices(prices) if prices else PRICES
    e = estimate(config, peers, days, samples_per_s, prices=table, reduce_s=reduce_s, uplink_mbit_s=uplink_mbit,
                 scheduler_poll_s=scheduler_poll, micro_batch=micro_batch, scheduler_egress=not scheduler_in_region,
                 aggregators=aggregators)
    if as_json:
        typer.echo(e.model_dump_json())
        return
    from rich.console import Console
    show(e, table, Console())


@app.command()
def plot(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         out: str = typer.Option(..., help="folder for the PNG figures")):
    """Draw the ledger as PNGs: loss, samples/s and contributors per round."""
    _setup(False)
    from .monitoring.plots import write
    from .monitoring.status import status as get_status
    paths = write(get_status(_open(bucket, run, endpoint_url))["history"], out)
    typer.echo("\n".join(paths))


@app.command()
def report(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           out: str = typer.Option(..., help="the HTML file to write"),
           upload: bool = typer.Option(False, help="also put it in the bucket (runs/RUN/report/index.html)")):
    """Write one self-contained HTML page of the run (figures, leaderboard, rounds, evaluations)."""
    _setup(False)
    from .monitoring.report import publish, render
    r = _open(bucket, run, endpoint_url)
    page = render(r)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    typer.echo(f"report written to {out}")
    if upload:
        typer.echo(f"uploaded to {publish(r, page)}")


@app.command()
def verify(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           fraction: float = typer.Option(0.05, help="share of each round's accepted shards recomputed (at least one)"),
           until_round: Optional[int] = typer.Option(None, help="exit once round R is verified"),
           organizer_key: Optional[str] = _organizer_key("the verdicts and flags"),
           revoke: bool = typer.Option(False, help="also revoke flagged volunteers' keys (needs --organizer-key)"),
           device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available, else cpu)"),
           poll: float = typer.Option(5.0, help="seconds between looks for a newly committed round"),
           verbose: bool = True):
    """Validate a run: recompute a random share of each committed round's shards, flag the
    volunteers whose shards do not match their data or copy another's (docs/verification.md)."""
    _setup(verbose)
    from .checks.verify import Verifier, summary
    org = identity.load(organizer_key) if organizer_key else None
    if revoke and org is None:
        raise typer.BadParameter("--revoke needs --organizer-key", param_hint="--revoke")
    r = Run(Bucket(bucket, endpoint_url=endpoint_url), run, organizer=org)
    v = Verifier(r, fraction=fraction, device=device, poll_s=poll, revoke=revoke)
    typer.echo(f"verified up to round {v.serve(until_round) - 1}: {summary(v.tally)}")
