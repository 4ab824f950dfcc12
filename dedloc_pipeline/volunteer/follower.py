"""Which state a volunteer computes on, and the round view of it.

A worker moves to a new state when the round view names one (reading that COMMIT and its delta,
in the background while it computes on), and leaves when the view says the run is stopped.
Without a fresh view (none yet, or unchanged for its ``view.lifetime`` by this machine's clock:
no scheduler, or it died or is busy reducing) it still notices new states and the STOP
marker by reading LATEST and STOP itself every ``fallback_s``. What a stale view still proves is
used: a state newer than the worker's, a closed round, STOP, a scheduler that ended.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from ..compute.accumulator import Accumulation
from ..protocol import heartbeat, shard, view as published
from ..protocol.clock import Clock, duration
from ..protocol.run import Run, RunError
from ..protocol.view import RoundView, View
from ..storage.vector import CorruptShard
from ..trust import identity
from .transfers import Transfers
from .upload_policy import Parts

log = logging.getLogger(__name__)


class Follower:
    """The state computed on (``state``, its ``params`` and COMMIT hash), STOP as seen, and
    round ``state`` as the last fresh round view showed it (``view``). A new state is installed
    into ``local`` (the model, what it accumulated, the stream's position) and ``parts``."""

    def __init__(self, run: Run, peer: str, clock: Clock, transfers: Transfers, local: Accumulation,
                 parts: Parts, delayed: bool, fallback_s: float) -> None:
        self.run, self.peer, self.clock, self.transfers = run, peer, clock, transfers
        self.local, self.parts, self.delayed, self.fallback_s = local, parts, delayed, fallback_s
        self.reader = published.Reader(run.config.peer_timeout_s, run.config.cadence.heartbeat_max_s, clock,
                                       run.config.organizer_key)
        self.state: int | None = None
        self.params = None
        self.state_hash = ""  # shard.commit_hash of state's COMMIT
        self.stopped = False  # the organizer wrote the run's STOP marker
        self.view: RoundView | None = None
        self.looked = float("-inf")  # clock.monotonic() of the last round-view read
        self.read_at: float | None = None  # the same, never reset: how old the view in hand is
        self.behind = False  # the fresh view is of an older state than this worker's
        self._closed_seen: float | None = None  # when the view first showed round ``state`` closed
        self._closed_at: float | None = None  # ... and when the scheduler closed it, by its own clock
        self._full_seen: float | None = None  # ... full (closed, or its validated samples at the target)
        self._reduce_s: float | None = None  # from then to the next state, last time
        self._installed_at: float | None = None  # clock.monotonic() when ``state`` was installed
        self.round_s: float | None = None  # from one state to the next, last time (heartbeats' keep-alive)
        self._named: tuple[int, float | None, float] | None = None  # (state, the view's time, read at) of the newest
        # the last states installed, with when they were named, seen and held (heartbeats carry them)
        self.held: deque[tuple[int, float | None, float, float]] = deque(maxlen=heartbeat.HELD)
        self._last_sync = 0.0

    def sync(self, latest: int | None = None) -> bool:
        """Move to the newest committed state (LATEST and the COMMITs say which; STOP is read
        too), or to state ``latest`` when the round view names it; True if it changed. This
        waits for the download: the round view's new states are fetched in the background
        (``prefetch``) instead."""
        if latest is None:
            self._last_sync = self.clock.time()
            self.stopped = self.run.stopped()
            latest = self.run.latest()
        if self.state is not None and latest <= self.state:
            return False
        self._name(latest, None)
        try:
            loaded = self.load(latest, self.state, self.params)
        except CorruptShard:
            if self.run.latest() == latest:
                raise
            return self.sync()  # pruned under our feet by newer commits: take the newest
        return loaded is not None and self.install(latest, *loaded)

    def load(self, latest: int, state: int | None, base) -> tuple[object, dict] | None:
        """The parameters of committed state ``latest`` and its COMMIT: from ``base`` (those of
        ``state``) and the delta when it is the next state, else the snapshot; None if it is not
        committed. Touches nothing of the follower's, so it runs on the transfer thread too."""
        try:
            commit = self.run.commit_of(latest)
        except RunError:  # the view named a state whose COMMIT is not there: only COMMITs count
            log.warning("%s: the round view names state %d, which is not committed", self.peer, latest)
            return None
        except identity.IdentityError as exc:  # a forged COMMIT is no state: keep computing on ours
            log.error("%s: %s", self.peer, exc)
            return None
        if state is not None and latest == state + 1:
            try:
                return self.run.apply_delta(latest, base, commit), commit
            except Exception as exc:  # any mismatch: the snapshot is the truth
                log.warning("%s: delta of state %d unusable (%s); reading the snapshot", self.peer, latest, exc)
        return self.run.load_params(latest, commit), commit

    def install(self, latest: int, params, commit: dict) -> bool:
        """Make state ``latest`` the one computed on (between micro-batches); its shards will
        name its COMMIT's hash. The first one resumes this peer's stream; gradients more than
        one step behind are too stale to use, the rest is carried once or dropped."""
        if self.state is None:
            self.local.cursor = self.resume_cursor(latest)
        elif latest <= self.state:
            return False
        elif latest > self.state + 1 and self.local.acc is not None:
            self.local.drop(self.params)
        now = self.clock.monotonic()
        if self._closed_seen is not None:  # the reduction's length by the scheduler's clock where known:
            # by when this worker noticed the state, its own lateness would stretch its next waits
            reduced = commit.get("committed_at", 0.0) - self._closed_at if self._closed_at is not None else None
            self._reduce_s = max(0.0, reduced) if reduced is not None and latest == self.state + 1 \
                else now - self._closed_seen
            self._closed_seen = self._closed_at = None
        self._full_seen = None
        if self.state is not None and latest == self.state + 1 and self._installed_at is not None:
            self.round_s = now - self._installed_at
        self._installed_at = now
        named = self._named if self._named is not None and self._named[0] == latest else None
        self.held.append((*(named or (latest, None, self.clock.time())), self.clock.time()))
        self.local.rebase(params)
        self.params, self.state, self.state_hash = params, latest, shard.commit_hash(commit)
        self.view = None
        self.looked = float("-inf")  # the view read before this was of the old state
        self.parts.forget_before(latest)
        self.local.retarget(latest, params, self.delayed, self.peer)
        log.info("%s: at state %d", self.peer, latest)
        return True

    def prefetch(self, latest: int) -> None:
        """Download state ``latest`` on the transfer thread while the worker computes; installed
        by the first step after it lands (``take_fetched``)."""
        if latest > self.state:
            self.transfers.fetch(latest, self.load, latest, self.state, self.params)

    def take_fetched(self, wait: bool) -> None:
        """Install the state downloaded in the background, once it is (waiting with ``wait``)."""
        got = self.transfers.fetched(wait)
        if got is None:
            return
        latest, job = got
        try:
            loaded = job.result()
        except CorruptShard:
            self.sync()  # pruned under our feet by newer commits: take the newest
            return
        if loaded is not None:
            self.install(latest, *loaded)

    def resume_cursor(self, r: int) -> int:
        """Continue this peer's stream after the samples it already uploaded: those counted up
        to state r (its streams record), and those in manifests of rounds not yet committed."""
        keys = self.run.keys
        end = int(self.run.stream_ends(r).get(self.peer, 0))
        for rr in (r - 1, r):
            if rr < 0:
                continue
            mkeys = self.run.bucket.find(keys.manifests_dir(rr, self.peer))
            for raw in self.run.bucket.read_many(mkeys).values():
                try:
                    m = shard.Manifest.model_validate_json(raw)
                    end = max([end] + [a + c for a, c in m.data.ranges])
                except ValueError:
                    continue
        return end

    def read(self, as_seen: Callable[[View], RoundView]) -> RoundView | None:
        """Read the round view again (one conditional GET): round ``state`` as ``as_seen`` makes it
        this peer's, or None without a fresh view of this state. It moves this peer to a newer
        state the view names, marks it stopped when the view says so, and, with no fresh view,
        reads LATEST and STOP itself every ``fallback_s``."""
        self.looked = self.read_at = self.clock.monotonic()
        v = self.reader.read(self.run.bucket, self.run.keys)
        fresh = self.reader.fresh
        if v is not None:
            self.stopped = self.stopped or v.stopped  # facts even in a stale view: STOP stays,
            if v.state > self.state:  # a state once committed stays committed
                self._name(v.state, v.at)
                self.prefetch(v.state)
            elif v.state == self.state and v.closed and self._closed_seen is None:
                self._closed_seen, self._closed_at = self.clock.monotonic(), v.at
        if not (fresh and v.state == self.state) and self.transfers.fetching is None \
                and self.clock.time() - self._last_sync >= self.fallback_s:
            self.sync()
        usable = v is not None and v.state == self.state and (fresh or v.closed or v.ended is not None)
        self.view = as_seen(v) if usable else None
        if self.view is not None:
            full = self.view.closed or self.view.manifest_samples >= self.run.config.target_batch_size
            self._full_seen = (self.looked if self._full_seen is None else self._full_seen) if full else None
        self.behind = fresh and v.state < self.state  # not published since this state: look again soon
        return self.view

    def _name(self, state: int, at: float | None) -> None:
        """State ``state`` is known to be committed: by a round view of the scheduler's time
        ``at``, or (None) by LATEST. The first time counts: how late it was held is from then."""
        if self._named is None or self._named[0] < state:
            self._named = (state, at, self.clock.time())

    def scheduler_note(self) -> str | None:
        """What is wrong with the scheduler as this worker sees it, for its display; None when a
        fresh view of this state is in hand."""
        v, reader = self.reader.view, self.reader
        if v is not None and v.ended is not None and v.state == self.state:
            return f"no scheduler: {v.ended}"
        if reader.fresh:
            return None
        if v is None:
            return "no scheduler has published yet"
        silent = self.clock.monotonic() - reader.changed
        return f"no scheduler has published for {duration(silent)}" if silent < float("inf") else \
            "no fresh round view yet"

    def waited(self) -> float | None:
        """How long round ``state`` has been full as this worker saw it (None: not full): what
        it waits for is the next state."""
        return None if self._full_seen is None else self.clock.monotonic() - self._full_seen

    def reduce_left(self) -> float:
        """Round ``state`` closed: how long until its state, if it is reduced as fast as the last
        one was (unknown: soon)."""
        since = 0.0 if self._closed_seen is None else self.clock.monotonic() - self._closed_seen
        return max(0.0, (self._reduce_s or 0.0) - since)

    def expected(self) -> bool:
        """Round ``state`` closed and its state due (as ``reduce_left`` counts) soon, or past due
        by at most the last reduction's length: a reduction held up longer is not expected any
        moment. False before the view showed it closed, or with no reduction measured yet."""
        if self._closed_seen is None or self._reduce_s is None:
            return False
        return self.clock.monotonic() - self._closed_seen <= 2 * self._reduce_s
