"""What a worker checks before it joins, so a misconfigured volunteer fails at start, in one
line, instead of having every shard rejected: that it is enrolled with the key it signs with
(signed runs), and that no other live worker uses its peer id."""

from __future__ import annotations

from ..protocol import heartbeat
from ..protocol.clock import Clock
from ..protocol.run import Run, RunError
from ..trust import identity


def check_not_live(run: Run, peer: str, clock: Clock) -> None:
    """Refuse a peer id another live worker uses (two machines started with one id): their
    shards would share one data stream, and one twin's would be rejected every round. Its
    heartbeats of the open round and the next (two GETs) say whether it is live; one that left
    (Ctrl-C, SIGTERM) said so in its last heartbeat, and one killed counts as gone once its
    last heartbeat's lifetime passed (``heartbeat.lifetime``), as the scheduler counts it."""
    try:
        r = run.latest()
    except RunError:
        return
    cfg = run.config
    for rr in (r, r + 1):
        beat = heartbeat.parse(run.bucket.read_bytes(run.keys.progress(rr, peer)))
        if beat is None or beat.left:
            continue
        age = clock.time() - beat.time
        lifetime = heartbeat.lifetime(beat, cfg.peer_timeout_s, cfg.cadence.heartbeat_max_s)
        if abs(age) < lifetime:
            raise RunError(f"peer id {peer!r} is live on another machine (its heartbeat of round {rr} is "
                           f"{max(0.0, age):.0f} s old): give this one another --peer-id. "
                           f"If that was this machine before a crash, start again in {lifetime - max(0.0, age):.0f} s")


def check_enrolled(run: Run, peer: str, signer: identity.Ed25519PrivateKey | None) -> None:
    """In a run that requires signatures, fail at start, not with every shard rejected."""
    org = run.config.organizer_key
    if org is None:
        return
    if signer is None:
        raise identity.IdentityError(f"run {run.name!r} admits only signed shards: pass --key "
                                     "(make one with `dedloc keygen`)")
    roster = identity.read_roster(run.bucket, run.name, org)
    mine, problem = identity.public(signer), "nobody is enrolled yet"
    if roster is not None:
        try:
            problem = None if roster.key_of(peer) == mine else f"peer {peer!r} is enrolled with another key"
        except identity.IdentityError as exc:
            problem = str(exc)
    if problem:
        raise identity.IdentityError(f"run {run.name!r}: {problem}; send the organizer your volunteer "
                                     f"name and your public key {mine}")
