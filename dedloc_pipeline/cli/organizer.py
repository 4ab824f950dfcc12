"""The organizer's commands: create a run, schedule its rounds, enrol volunteers, stop, repair, validate."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ..protocol.config import recipe_config
from ..protocol.run import RunError, init_run
from ..storage.bucket import Bucket
from ..trust import identity
from ..trust.identity import IdentityError
from .common import BucketOpt, EndpointOpt, RunOpt, app, open_run, organizer_key, setup
from .init_options import config_args, with_settings


@app.command()
@with_settings
def init(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         verbose: bool = False, **settings):
    """Create a run in the bucket and commit state 0."""
    setup(verbose)
    organizer = identity.load(settings["organizer_key"]) if settings.get("organizer_key") else None
    r = init_run(Bucket(bucket, endpoint_url=endpoint_url), recipe_config(run, **config_args(settings)), organizer)
    typer.echo(f"run {run} ready in {bucket}: {r.flat.n:,} parameters, state 0 committed")


@app.command()
def aggregate(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
              until_round: Optional[int] = typer.Option(None, min=0, help="exit once state R is committed"),
              parallel: int = typer.Option(2, min=1, help="aggregator threads"),
              poll: Optional[float] = typer.Option(None, min=0, help="fixed seconds between polls (default: the run's "
                                                   "cadence, often near the target, seldom far from it)"),
              organizer_key: Optional[str] = organizer_key("CLOSE, COMMIT, LATEST, streams and the round view"),
              standby: bool = typer.Option(False, help="while another scheduler holds the run's lease, wait "
                                           "and take over when it ends (default: refuse, naming it)"),
              volunteers: bool = typer.Option(False, help="give the parts to volunteer aggregators, two to a "
                                              "part, computing here what they do not settle (docs/aggregators.md)"),
              verbose: bool = True):
    """Schedule rounds: close, reduce, apply, commit (no Prefect needed)."""
    setup(verbose)
    from ..organizer.scheduler import Scheduler
    r = open_run(bucket, run, endpoint_url, organizer_key)
    state = Scheduler(r, parallel, poll, volunteers=volunteers).serve(until_round, standby=standby)
    typer.echo(f"state {state} committed")


@app.command()
def aggregator(limit: int = typer.Option(2, help="task runs at once (0: no limit); each reads one part of every shard"),
               timeout: Optional[float] = typer.Option(None, help="stop after SECONDS"),
               verbose: bool = True):
    """Aggregate for an organizer's Prefect rounds from this machine: a task worker serving the
    reduce and apply tasks of `pretrain` runs with runner=task-workers (infra/README.md). Needs
    PREFECT_API_URL, the shared task storage, and the bucket's credentials."""
    setup(verbose)
    from flows.aggregators import serve
    serve(limit=limit or None, timeout_s=timeout)


@app.command()
def stop(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         reason: str = typer.Option("stopped by the organizer", help="recorded in the marker"),
         organizer_key: Optional[str] = organizer_key("STOP (no other STOP counts)")):
    """End a run: schedulers and the pretrain flow stop after the open round."""
    setup(False)
    r = open_run(bucket, run, endpoint_url, organizer_key)
    if not r.stop(reason):
        typer.echo(f"run {run}: already stopped")
        return
    typer.echo(f"run {run}: STOP marker written at state {r.latest()}")


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
    from ..trust.policy import policy_for, r2_notice
    options = {"data": data}
    if format == "r2":
        options.update(ttl_seconds=ttl, **({"parent_access_key_id": parent_access_key_id}
                                           if parent_access_key_id else {}))
    typer.echo(json.dumps(policy_for(bucket, run, peer, format, **options), indent=2))
    if format == "r2":
        typer.echo(r2_notice(bucket, run, peer, data, ttl), err=True, nl=False)


def _change_roster(bucket: str, run: str, endpoint: str | None, organizer_key: str, **change):
    """Enrol or revoke in a signed run's roster, with the key the run was created with; a key a
    flag names is not enrolled again, under any name."""
    setup(False)
    r = open_run(bucket, run, endpoint)
    org = identity.load(organizer_key)
    if r.config.organizer_key is None:
        raise RunError(f"run {run!r} was created without --organizer-key: it accepts unsigned shards")
    if identity.public(org) != r.config.organizer_key:
        raise IdentityError(f"{organizer_key} is not the key run {run!r} was created with")
    from ..checks import flags
    return identity.update_roster(r.bucket, run, org, refused=flags.refused_keys(flags.read(r)), **change)


@app.command()
def repair(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           apply: bool = typer.Option(False, "--apply", help="do it: move what is damaged under runs/RUN/damaged/ "
                                      "and go back to the newest intact state (default: say what would be done)"),
           organizer_key: Optional[str] = organizer_key("LATEST")):
    """Check the newest states against their COMMITs; repair a damaged run (exit 1: damage not repaired)."""
    setup(False)
    from ..organizer.repair import repair as repair_run
    if not repair_run(open_run(bucket, run, endpoint_url, organizer_key), apply, typer.echo):
        raise typer.Exit(1)


@app.command()
def verify(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           fraction: float = typer.Option(0.05, help="share of each round's accepted shards recomputed (at least one)"),
           until_round: Optional[int] = typer.Option(None, min=0, help="exit once round R is verified"),
           organizer_key: Optional[str] = organizer_key("the verdicts and flags"),
           revoke: bool = typer.Option(False, help="also revoke flagged volunteers' keys (needs --organizer-key)"),
           device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available, else cpu)"),
           poll: float = typer.Option(5.0, help="seconds between looks for a newly committed round"),
           verbose: bool = True):
    """Validate a run: recompute a random share of each committed round's shards, flag the
    volunteers whose shards do not match their data or copy another's (docs/verification.md)."""
    setup(verbose)
    from ..checks.verify import Verifier, ended
    if revoke and not organizer_key:
        raise typer.BadParameter("--revoke needs --organizer-key", param_hint="--revoke")
    r = open_run(bucket, run, endpoint_url, organizer_key)
    v = Verifier(r, fraction=fraction, device=device, poll_s=poll, revoke=revoke)
    typer.echo(ended(v.serve(until_round) - 1, v.tally))
