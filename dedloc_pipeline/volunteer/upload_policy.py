"""When a volunteer uploads: the round as it sees it, and the rule that decides.

Pure and torch-free: what the worker knows (the published view, its own heartbeats and shards,
the clock's reading) goes in, a ``RoundView`` or a decision comes out, so the rule can be read
and tested apart from the loop that follows it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable

from ..protocol import heartbeat
from ..protocol.clock import Clock
from ..protocol.heartbeat import Heartbeat
from ..protocol.view import RoundView, View, for_worker

if TYPE_CHECKING:
    from .transfers import Sent


def should_upload(v: RoundView, mine: int, target: int, first: bool) -> bool:
    """Upload once the round can fill. A peer that already uploaded sends another part only
    when its pending samples are needed: they alone cover what the manifests lack, or the
    live peers' pending samples fall short without them (a peer vanished)."""
    expected = v.manifest_samples + v.fresh_samples
    if first:
        return expected + mine >= target
    return mine >= target - v.manifest_samples or expected < target <= expected + mine


def from_view(v: View, r: int, beats: Iterable[Heartbeat], sent: Iterable[Sent], timeout: float,
         ahead_s: float, target: int) -> RoundView:
    """Round r as the published view ``v`` shows it to this peer: less this peer's own
    heartbeat in it, plus this peer's shards it cannot show yet. Which of its heartbeats
    (``beats``, oldest first) the scheduler read (between ``v.at`` and ``v.written_at``) is not
    known exactly: the newest one written before ``v.at`` or any written while it read, so the
    largest pending count among those is taken out, each less this peer's shards the view listed
    beyond those the heartbeat had counted as landed (as the scheduler subtracts them). The
    others' pending samples are never overestimated: this peer never uploads early on its own
    samples. Its shards (``sent``) finished after ``v.at`` are added (the view listed before
    them); those finished before it say whether this peer has reached the view's cap."""
    pending, speed, counted = 0, 0.0, False
    ours = [x for x in sent if x.round == r]
    seen = sum(x.samples for x in ours if x.at <= v.at)  # its manifests the view listed
    live = [(b, c) for b in beats if (c := heartbeat.counted(b, r, v.at, timeout, target, ahead_s, seen)) is not None]
    maybe = [c for b, c in live if b.time <= v.at][-1:] + [c for b, c in live if v.at < b.time <= v.written_at]
    if maybe and not v.closed:  # as the scheduler counted it: projected to v.at, less the shards it listed
        pending, speed, counted = max(c.samples for c in maybe), maybe[-1].samples_per_s, True
    unseen = sum(x.samples for x in ours if x.at > v.at)
    ahead = [c.samples_per_s for b in beats if (c := heartbeat.counted(b, r + 1, v.at, timeout, target, ahead_s))]
    ahead = ahead[-1] if ahead else None
    return for_worker(v, pending, speed, counted, unseen, seen, ahead)


def without_view(r: int, sent: Iterable[Sent], now: float) -> RoundView:
    """Round r without a fresh view: nobody's counts but this peer's own shards."""
    return RoundView(manifest_samples=sum(x.samples for x in sent if x.round == r), at=now)


def projected(v: RoundView, now: float, target: int) -> RoundView:
    """The others' pending samples grow at their speed since the scheduler counted them
    (``v.at``, until their next heartbeats are due: at most ``heartbeat_max_s``, so a skewed
    clock costs little): between reads, and with a view a scheduler poll old, a worker still
    sees the round fill."""
    grown = heartbeat.project(v.fresh_samples, v.samples_per_s, now - v.at, v.horizon_s, target)
    return dataclasses.replace(v, fresh_samples=grown)


class Parts:
    """The rounds this peer sent a part to, and since when a second part looked needed."""

    def __init__(self, clock: Clock, lockstep: bool) -> None:
        self.clock, self.lockstep = clock, lockstep
        self.uploaded: set[int] = set()
        self._short_since: tuple[int, float] | None = None  # (round, since when)

    def sent(self, r: int) -> None:
        self.uploaded.add(r)
        self._short_since = None

    def not_short(self) -> None:
        self._short_since = None

    def forget_before(self, state: int) -> None:
        self.uploaded = {x for x in self.uploaded if x >= state}

    def still_short(self, r: int, upload_s: float) -> bool:
        """A second part of round r goes only once it has looked needed for twice this peer's
        last upload time (``upload_s``): the others' shards under way (as long to send as this
        peer's, about) land first, and the samples are carried to the next round instead of
        arriving after CLOSE. A first part goes at once; so does any part in lock-step."""
        if r not in self.uploaded or self.lockstep:
            return True
        now = self.clock.monotonic()
        if self._short_since is None or self._short_since[0] != r:
            self._short_since = (r, now)
        return now - self._short_since[1] >= 2 * upload_s
