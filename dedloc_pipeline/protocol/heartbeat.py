"""A volunteer's heartbeat: the one record it writes besides its shards, and how it is counted.

The worker writes one for the round it accumulates (``RunLayout.progress``) every
``cadence.heartbeat_s``: its pending samples (``sending``: those of its shards still on their
way), its speed, when its next one is due, and its totals (uploaded samples, compute and wall
seconds, bucket bytes) for displays and benchmarks. The scheduler counts the live peers'
heartbeats into the round view; ``dedloc status`` and the benchmarks read them too.

Every value in it is a claim, so a heartbeat is bounded before it counts: one above
``MAX_HEARTBEAT_BYTES`` is not read, a malformed one is skipped, speed is clamped to
``[0, MAX_PEER_SPEED]``, and in a round's count pending samples are clamped to ``[0, target]``
and one older than the run's ``peer_timeout_s`` (or as far in the future) is a peer gone.

Torch-free: the scheduler and ``dedloc status`` import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

from ..storage.bucket import Bucket
from ..storage.layout import RunLayout, volunteer_of

MAX_HEARTBEAT_BYTES = 4096  # an honest heartbeat is ~300 bytes (peer ids are at most 64 characters)
MAX_PEER_SPEED = 1e5  # samples/s one peer may claim (display and ETA only; never an upload decision)


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat, its JSON fields as written. Parsed, ``next_s`` is None when the writer
    did not say (an older worker): the reader's own bound applies."""

    peer: str
    round: int
    samples: int  # pending: computed and not yet in a landed manifest (``sending`` included)
    sending: int  # of those, the samples of shards on their way
    samples_per_s: float
    next_s: float | None  # when the next heartbeat is due, from ``time``
    time: float  # the writer's clock
    uploaded_samples: int = 0
    compute_s: float = 0.0  # in forward and backward, since the worker started
    wall_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    left: bool = False  # its last one: the peer left (Ctrl-C, SIGTERM), so the id is free again


def write(bucket: Bucket, keys: RunLayout, beat: Heartbeat) -> None:
    bucket.write_json(keys.progress(beat.round, beat.peer), asdict(beat))


def parse(raw: bytes | None) -> Heartbeat | None:
    """A heartbeat's bytes, bounded (size, types, finite values, speed clamped); None if it is
    unreadable. Which round and time it may count for is ``counted``'s to say."""
    if raw is None or len(raw) > MAX_HEARTBEAT_BYTES:
        return None
    try:
        p = json.loads(raw)
        if not isinstance(p, dict):
            return None
        r, t = p.get("round"), float(p["time"])
        if not isinstance(r, (int, float)) or r != int(r) or not math.isfinite(t):
            return None
        samples = p.get("samples", 0)
        if isinstance(samples, bool) or not isinstance(samples, (int, float)) or not math.isfinite(samples):
            return None
        speed = float(p.get("samples_per_s", 0.0))
        next_s = None if "next_s" not in p else float(p["next_s"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None
    peer = p.get("peer")
    return Heartbeat(peer=peer if isinstance(peer, str) else "", round=int(r), samples=int(samples),
                     sending=int(_number(p.get("sending"))),
                     samples_per_s=min(max(speed, 0.0), MAX_PEER_SPEED) if math.isfinite(speed) else 0.0,
                     next_s=None if next_s is None else (max(next_s, 0.0) if math.isfinite(next_s) else 0.0),
                     time=t, uploaded_samples=int(_number(p.get("uploaded_samples"))),
                     compute_s=_number(p.get("compute_s")), wall_s=_number(p.get("wall_s")),
                     bytes_up=int(_number(p.get("bytes_up"))), bytes_down=int(_number(p.get("bytes_down"))),
                     left=p.get("left") is True)


def _number(x) -> float:
    """A total for display: a finite, non-negative number, else 0."""
    try:
        ok = not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:  # an integer beyond any float
        return 0.0
    return max(float(x), 0.0) if ok else 0.0


class Counted(NamedTuple):
    samples: int  # pending, projected to the count's time, within [0, target]
    samples_per_s: float
    horizon_s: float  # how long past its time it was projected, at most


def counted(beat: Heartbeat | None, r: int, now: float, timeout: float, target: int,
            ahead_s: float = 0.0) -> Counted | None:
    """What ``beat`` counts toward round r at ``now``; None if it does not count: unreadable,
    another round, or older (or further ahead) than ``timeout``. The pending samples are
    projected to ``now`` at the peer's speed until its next heartbeat is due (its ``next_s``, at
    most ``ahead_s`` seconds): heartbeats can then be seldom without the count lagging behind
    the work, and a peer that heartbeats every step (lock-step tests) is never projected, so
    what it counts does not depend on the machine's load."""
    if beat is None or beat.round != r or abs(now - beat.time) >= timeout:
        return None
    speed = min(max(beat.samples_per_s, 0.0), MAX_PEER_SPEED)
    horizon = ahead_s if beat.next_s is None else min(max(beat.next_s, 0.0), ahead_s)
    return Counted(project(beat.samples, speed, now - beat.time, horizon, target), speed, horizon)


def project(samples: int, speed: float, since_s: float, ahead_s: float, target: int) -> int:
    """Pending samples ``since_s`` seconds after they were counted, at ``speed``, projected for
    at most ``ahead_s`` seconds; within [0, target]."""
    return min(max(int(samples + speed * min(max(since_s, 0.0), ahead_s)), 0), target)


@dataclass(frozen=True)
class Pending:
    """A round's live heartbeats, summed: what the round view publishes of them."""

    samples: int = 0
    samples_per_s: float = 0.0
    peers: int = 0
    ignored: int = 0
    horizon_s: float = 0.0  # the longest of the counted heartbeats' horizons
    volunteers: frozenset[str] = frozenset()  # whose heartbeats counted


class Heartbeats:
    """A round's heartbeats as the scheduler last read them. Each poll lists the round (one
    LIST, with sizes and version tags) and GETs only the heartbeats written since: a peer's
    heartbeat is read about once per write, not once per poll. Any other key under the
    heartbeats' folder, and one above ``MAX_HEARTBEAT_BYTES``, is not read."""

    def __init__(self) -> None:
        self._raw: dict[str, tuple[str | None, bytes | None]] = {}  # key -> (tag, bytes)

    def pending(self, bucket: Bucket, keys: RunLayout, r: int, listed: dict[str, tuple[int, str | None]],
                now: float, timeout: float, target: int, ahead_s: float = 0.0) -> Pending:
        """Round r's live heartbeats at ``now``, from ``listed`` (the round's listing)."""
        beats = {k: e for k, e in listed.items() if k == keys.progress(r, keys.peer_of_progress(k))}
        small = {k: tag for k, (n, tag) in beats.items() if n <= MAX_HEARTBEAT_BYTES}
        known = {k: v for k, v in self._raw.items() if k in small}  # other rounds', and deleted ones, go
        changed = [k for k, tag in small.items() if tag is None or known.get(k, (None,))[0] != tag]
        for k, raw in bucket.read_many(changed).items():
            known[k] = (small[k], raw)
        self._raw = known
        samples, speed, peers, horizon, names = 0, 0.0, 0, 0.0, set()
        for k, (_, raw) in known.items():
            got = counted(parse(raw), r, now, timeout, target, ahead_s)
            if got is not None:
                samples, speed, peers = samples + got.samples, speed + got.samples_per_s, peers + 1
                horizon = max(horizon, got.horizon_s)
                names.add(volunteer_of(keys.peer_of_progress(k)))
        return Pending(samples=samples, samples_per_s=speed, peers=peers, ignored=len(beats) - len(small),
                       horizon_s=horizon, volunteers=frozenset(names))
