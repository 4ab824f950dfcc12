"""A volunteer's heartbeat: the one record it writes besides its shards, and how it is counted.

A heartbeat is a projection, not a sample: "from ``time``, my pending samples (``samples``:
those of my shards still on their way, ``sending``, included) grow at ``samples_per_s`` until
``next_s``, when my next heartbeat is due". Readers project it, and subtract the samples of the
peer's manifests in the round beyond those it had counted as landed (``landed``): a landed
shard moves its samples from pending to the manifests without a heartbeat. So the worker
writes one only when the projection would go wrong (``due``): in a round it has not heartbeaten
yet, when its count strays from the projection (its speed changed, it stopped computing the
round), when ``next_s`` has passed (the keep-alive, a share of the round's length), and as it
leaves. The scheduler counts the live peers' heartbeats into the round view; ``dedloc status``
and the benchmarks read them too, with the worker's totals (uploaded samples, compute and wall
seconds, bucket bytes).

Every value in it is a claim, so a heartbeat is bounded before it counts: one above
``MAX_HEARTBEAT_BYTES`` is not read, a malformed one is skipped, speed is clamped to
``[0, MAX_PEER_SPEED]``, pending samples are clamped to ``[0, target]``, and a peer is gone once
its heartbeat is older than its lifetime (``lifetime``: the run's ``peer_timeout_s``, longer
when the heartbeat said its next is due later than a third of that) or as far in the future.

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
    landed: int = 0  # samples of its shards of the round whose manifests had landed (not in ``samples``)
    upload_s: float = 0.0  # how long its last upload took (the latency budget's, benchmarks/latency.py)
    # its last states (at most HELD), each (state, when the round view named it by the scheduler's
    # clock, None if found another way; when this worker read that; when it held the state)
    held: tuple[tuple[int, float | None, float, float], ...] = ()


HELD = 4  # the states a heartbeat tells how late they arrived


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
                     left=p.get("left") is True, landed=int(_number(p.get("landed"))),
                     upload_s=_number(p.get("upload_s")), held=_held(p.get("held")))


def _held(x) -> tuple:
    """The states a heartbeat says it held and when (display and benchmarks only): at most
    ``HELD``, each of finite numbers, else none."""
    if not isinstance(x, list) or len(x) > HELD:
        return ()
    held = []
    try:
        for h in x:
            if not (isinstance(h, list) and len(h) == 4 and all(
                    v is None and i == 1 or not isinstance(v, bool) and isinstance(v, (int, float))
                    and math.isfinite(v) for i, v in enumerate(h))) or h[0] != int(h[0]):
                return ()
            held.append((int(h[0]), None if h[1] is None else float(h[1]), float(h[2]), float(h[3])))
    except OverflowError:  # an integer beyond any float
        return ()
    return tuple(held)


def _number(x) -> float:
    """A total for display: a finite, non-negative number, else 0."""
    try:
        ok = not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:  # an integer beyond any float
        return 0.0
    return max(float(x), 0.0) if ok else 0.0


class BeatCount(NamedTuple):
    samples: int  # pending, projected to the count's time, within [0, target]
    samples_per_s: float
    horizon_s: float  # how long past its time it was projected, at most


def lifetime(beat: Heartbeat, timeout: float, ahead_s: float) -> float:
    """Seconds a heartbeat counts after its time: ``timeout`` (the run's ``peer_timeout_s``),
    or its own interval (``next_s``, at most ``ahead_s``; unsaid, none) plus two thirds of
    ``timeout`` when that is longer. A peer in long rounds heartbeats seldom, and is still given
    the same slack past its next heartbeat's due time as one heartbeating every third of
    ``timeout``."""
    due = 0.0 if beat.next_s is None else min(max(beat.next_s, 0.0), ahead_s)
    return max(timeout, due + 2 * timeout / 3)


def counted(beat: Heartbeat | None, r: int, now: float, timeout: float, target: int,
            ahead_s: float = 0.0, landed: int = 0) -> BeatCount | None:
    """What ``beat`` counts toward round r at ``now``; None if it does not count: unreadable,
    another round, its peer's last (it left: no live peer), or past its ``lifetime`` (or as far
    ahead). The pending samples are projected
    to ``now`` at the peer's speed until its next heartbeat is due (its ``next_s``, at most
    ``ahead_s`` seconds), less what its manifests in the round hold beyond what it had counted
    as landed (``landed``: their samples, as listed): heartbeats can then be
    seldom without the count lagging behind the work, and a peer that heartbeats every step
    (lock-step tests) is never projected, so what it counts does not depend on the machine's
    load."""
    if beat is None or beat.round != r or beat.left or abs(now - beat.time) >= lifetime(beat, timeout, ahead_s):
        return None
    horizon = ahead_s if beat.next_s is None else min(max(beat.next_s, 0.0), ahead_s)
    return BeatCount(claimed(beat, now, landed, horizon, target), min(max(beat.samples_per_s, 0.0), MAX_PEER_SPEED),
                   horizon)


def claimed(beat: Heartbeat, now: float, landed: int, horizon: float, target: int) -> int:
    """What readers count of ``beat`` at ``now``: its pending samples less those of its shards
    that landed since (``landed``, as listed, beyond the ``landed`` it counted), grown at its
    speed for at most ``horizon`` seconds; within [0, target]."""
    since = max(0, landed - beat.landed)
    speed = min(max(beat.samples_per_s, 0.0), MAX_PEER_SPEED)
    return project(beat.samples - since, speed, now - beat.time, horizon, target)


def project(samples: int, speed: float, since_s: float, ahead_s: float, target: int) -> int:
    """Pending samples ``since_s`` seconds after they were counted, at ``speed``, projected for
    at most ``ahead_s`` seconds; within [0, target]."""
    return min(max(int(samples + speed * min(max(since_s, 0.0), ahead_s)), 0), target)


def due(last: Heartbeat | None, r: int, pending: int, landed: int, now: float, target: int, step: int,
        counts: bool = True) -> bool:
    """Whether a peer with ``pending`` samples of round r (computed, or on their way) and
    ``landed`` in its landed manifests there, whose last heartbeat was ``last``, writes one now:
    none for round r yet, its keep-alive due (``next_s``), or (where its count ``counts``: not in
    a round already full) its count strayed from what readers project of ``last``. Projected
    above it by more than two micro-batches (``step`` samples) the others would upload too early
    and wait for the rest, so that is corrected soon; below it by more than four, or a fiftieth
    of the target, they only upload a little late, and the batch comes out a little larger."""
    if last is None or last.round != r or now - last.time >= (last.next_s or 0.0):
        return True
    if not counts:
        return False
    counted = claimed(last, now, landed, last.next_s or 0.0, target)
    return counted - pending > 2 * step or pending - counted > max(4 * step, target // 50)


@dataclass(frozen=True)
class Pending:
    """A round's live heartbeats, summed: what the round view publishes of them."""

    samples: int = 0
    samples_per_s: float = 0.0
    peers: int = 0
    ignored: int = 0
    horizon_s: float = 0.0  # the longest of the counted heartbeats' horizons
    volunteers: frozenset[str] = frozenset()  # whose heartbeats counted
    unsent: frozenset[str] = frozenset()  # of those, with pending samples and no manifest in the round yet


class Heartbeats:
    """A round's heartbeats as the scheduler last read them. Each poll lists the volunteers'
    prefixes (one LIST, with sizes and version tags) and GETs only the heartbeats written since:
    a peer's heartbeat is read about once per write, not once per poll. A key off the layout,
    and a heartbeat above ``MAX_HEARTBEAT_BYTES``, is not read."""

    def __init__(self) -> None:
        self._raw: dict[str, tuple[str | None, bytes | None]] = {}  # key -> (tag, bytes)

    def pending(self, bucket: Bucket, keys: RunLayout, r: int, listed: dict[str, tuple[int, str | None]],
                now: float, timeout: float, target: int, ahead_s: float = 0.0,
                landed: dict[str, int] | None = None, refused: frozenset[str] = frozenset()) -> Pending:
        """Round r's live heartbeats at ``now``, from ``listed`` (the volunteers' listing);
        ``landed``: the samples of each peer's manifests in it (what their heartbeats'
        projections lose as their shards land). A peer in ``refused`` (a shard of its in round
        r was rejected) counts for nothing: its pending work would be judged the same way, and
        counted it would make the others upload early and then fill the round again."""
        beats = {k: listed[k] for k in keys.of_round(listed, r, "progress")}
        small = {k: tag for k, (n, tag) in beats.items() if n <= MAX_HEARTBEAT_BYTES}
        known = {k: v for k, v in self._raw.items() if k in small}  # other rounds', and deleted ones, go
        changed = [k for k, tag in small.items() if tag is None or known.get(k, (None,))[0] != tag]
        for k, raw in bucket.read_many(changed).items():
            known[k] = (small[k], raw)
        self._raw = known
        samples, speed, peers, horizon, names, unsent = 0, 0.0, 0, 0.0, set(), set()
        for k, (_, raw) in known.items():
            peer = keys.peer_of_progress(k)
            if peer in refused:
                continue
            got = counted(parse(raw), r, now, timeout, target, ahead_s, (landed or {}).get(peer, 0))
            if got is not None:
                samples, speed, peers = samples + got.samples, speed + got.samples_per_s, peers + 1
                horizon = max(horizon, got.horizon_s)
                names.add(volunteer_of(peer))
                if got.samples > 0:
                    unsent.add(volunteer_of(peer))
        sent = {volunteer_of(p) for p, n in (landed or {}).items() if n}
        return Pending(samples=samples, samples_per_s=speed, peers=peers, ignored=len(beats) - len(small),
                       horizon_s=horizon, volunteers=frozenset(names), unsent=frozenset(unsent - sent))
