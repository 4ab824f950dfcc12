"""The volunteer's commands: a key pair, and joining a run."""

from __future__ import annotations

from typing import Optional

import typer

from ..monitoring import stop as signals
from ..trust import identity
from .common import BucketOpt, EndpointOpt, RunOpt, app, setup


@app.command()
def keygen(out: str = typer.Option(..., help="file for the new private key (kept secret, never overwritten)")):
    """Make a volunteer's or organizer's Ed25519 key pair; prints the public key to share."""
    pub = identity.public(identity.generate(out))
    typer.echo(f"private key: {out} (keep it secret)\npublic key: {pub}")


@app.command()
def worker(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           peer_id: Optional[str] = typer.Option(None, help="stable id (default: random)"),
           until_round: Optional[int] = typer.Option(None, min=0, help="exit once state R is committed"),
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
           progress_every: float = typer.Option(10.0, min=0.5, help="seconds between plain progress lines"),
           aggregate: bool = typer.Option(False, "--aggregate", help="also aggregate parts of the model, if the "
                                          "organizer enrolled you to (docs/aggregators.md)"),
           verbose: bool = True):
    """Join a run as a volunteer: compute gradients and upload shards, with a live progress display.

    Ctrl-C (or SIGTERM, SIGHUP) finishes an upload under way, leaves, and prints what you
    contributed (exit status 130, 143, 129); a second one quits at once."""
    setup(verbose)
    from ..monitoring.volunteer import make_worker, summary_text, volunteer
    w = make_worker(bucket, run, peer_id, key, device, micro_batch, threads, poll, endpoint_url, precision,
                    organizer, write_profile)
    s = volunteer(w, until_round, plain=plain or None, every=progress_every, aggregate=aggregate)
    typer.echo(summary_text(s))
    if s["ended"] in ("ctrl_c", "interrupted"):
        raise typer.Exit(signals.exit_status(s["signal"]))
