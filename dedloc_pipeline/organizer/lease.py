"""The scheduler's lease: one scheduler closes a run's rounds at a time, and says who it is.

Two schedulers on one run are safe (CLOSE and COMMIT are create-once, reduction is idempotent),
but each would print "state N committed" for half the rounds and publish views that contradict
each other, and nobody would know. So a scheduler holds a lease in the bucket: generation ``g``
is ``runs/RUN/lease/{g:08d}.json``, created once (whoever creates it holds it) and then
rewritten only by its holder, every half of its ``ttl_s`` (``RENEW``). Another scheduler that
finds a live lease is refused with a message naming the holder (or, ``--standby``, waits for it). A lease is
free when its holder released it (a clean exit), stopped renewing it for ``ttl_s`` (a killed or
cut-off machine), or names this host and a process that no longer exists (a restart here need
not wait). Taking a free lease is creating generation ``g + 1``: of two schedulers racing for it,
one wins. A holder that was paused past its expiry finds ``g + 1`` at its next renewal and
stops (``LeaseLost``), so the window in which two act is at most one renewal interval.

Expiry is judged on the reader's wall clock against the holder's ``renewed_at``, as heartbeats
are: machines whose clocks differ by more than ``ttl_s`` would see a live lease as expired (and
the holder then stops, naming who took over).
"""

from __future__ import annotations

import logging
import os
import socket

from pydantic import BaseModel, ConfigDict, ValidationError

from ..protocol.clock import REAL, Clock, duration
from ..protocol.run import RunError
from ..storage.bucket import Bucket, Damaged
from ..storage.layout import RunLayout

log = logging.getLogger(__name__)

LEASE_S = 60.0  # a killed scheduler's lease frees this long after its last renewal
RENEW = 0.5  # renewed when this share of it has passed: at the first poll after (polls are 10 s at most)


class LeaseHeld(RunError):
    """Another scheduler holds the run's lease (``holder``: which, and since when)."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


class LeaseLost(RunError):
    """This scheduler's lease was taken over (it was not renewed in time)."""


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore")

    holder: str
    host: str
    pid: int
    started_at: float
    renewed_at: float
    ttl_s: float
    released: bool = False


def this_holder() -> str:
    """``host:pid``: what a person can find and stop."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _gone(record: Record) -> bool:
    """The holder is a process of this host that no longer exists."""
    if record.host != socket.gethostname():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, under another user
        return False
    return False


def newest(bucket: Bucket, keys: RunLayout) -> tuple[int, Record | None]:
    """The newest generation and its record (None: none yet, or unreadable, which frees it)."""
    found = [n for k in bucket.listing(keys.leases_dir)  # one LIST, even of an empty prefix
             if (n := keys.generation_of(k)) is not None]
    if not found:
        return -1, None
    g = max(found)
    try:
        return g, Record.model_validate(bucket.read_json(keys.lease(g)) or {})
    except (Damaged, ValidationError) as exc:
        log.warning("lease %s unreadable (%s): taken as free", keys.lease(g), str(exc).splitlines()[0])
        return g, None


def held(record: Record | None, now: float) -> bool:
    """A lease someone holds at ``now``: not released, and renewed within its time."""
    return record is not None and not record.released and now - record.renewed_at <= record.ttl_s


def describe(record: Record, now: float) -> str:
    """Who holds a lease and for how long, in one clause."""
    left = record.ttl_s - (now - record.renewed_at)
    return (f"{record.holder} (since {duration(max(0.0, now - record.started_at))} ago; renewed "
            f"{duration(max(0.0, now - record.renewed_at))} ago, free in {duration(max(0.0, left))} unless renewed)")


class Lease:
    """This scheduler's hold on a run: ``hold()`` before each poll takes or renews it."""

    def __init__(self, bucket: Bucket, keys: RunLayout, clock: Clock = REAL, holder: str | None = None,
                 ttl_s: float = LEASE_S) -> None:
        self.bucket, self.keys, self.clock, self.ttl_s = bucket, keys, clock, ttl_s
        self.holder = this_holder() if holder is None else holder
        self.generation: int | None = None
        self._record: Record | None = None
        self._renewed = float("-inf")  # clock.monotonic() of the last renewal

    def free(self, record: Record | None, now: float) -> bool:
        return not held(record, now) or record.holder == self.holder or _gone(record)

    def hold(self) -> None:
        """Take the lease, or renew it once ``RENEW`` of its time has passed (nothing otherwise:
        an unchanged poll costs no lease request). LeaseHeld if another holds it, LeaseLost if
        it was taken over."""
        now = self.clock.time()
        if self.generation is None:
            self._take(now)
        elif (self.clock.monotonic() - self._renewed >= self.ttl_s * RENEW
              or now - self._record.renewed_at >= self.ttl_s * RENEW):
            self._renew(now)

    def _take(self, now: float) -> None:
        g, record = newest(self.bucket, self.keys)
        if not self.free(record, now):
            holder = describe(record, now)
            raise LeaseHeld(f"run {self.keys.run} is scheduled by {holder}: stop that scheduler, "
                            "or start this one with --standby to take over when it ends", holder)
        if record is not None and record.holder == self.holder and not record.released:
            self.generation, self._record = g, record  # a scheduler of this process before: continue it
            self._renew(now)
            return
        mine = Record(holder=self.holder, host=socket.gethostname(), pid=os.getpid(), started_at=now,
                      renewed_at=now, ttl_s=self.ttl_s)
        if not self.bucket.create_json(self.keys.lease(g + 1), mine.model_dump()):
            _, won = newest(self.bucket, self.keys)
            raise LeaseHeld(f"run {self.keys.run}: another scheduler took the lease first"
                            + (f", {describe(won, now)}" if won is not None else ""))
        if record is not None and not record.released and record.holder != self.holder:
            log.warning("took over the lease of %s", describe(record, now))
        self.generation, self._record, self._renewed = g + 1, mine, self.clock.monotonic()
        log.info("lease %d of run %s held by %s", g + 1, self.keys.run, self.holder)

    def _renew(self, now: float) -> None:
        nxt = self.keys.lease(self.generation + 1)
        if self.bucket.exists(nxt):
            self.generation = None
            taker = self.bucket.read_json(nxt) or {}
            raise LeaseLost(f"run {self.keys.run}: this scheduler's lease was taken over by "
                            f"{taker.get('holder', '?')} (it was not renewed within {duration(self.ttl_s)})")
        self._record = self._record.model_copy(update={"renewed_at": now})
        self.bucket.write_json(self.keys.lease(self.generation), self._record.model_dump())
        self._renewed = self.clock.monotonic()

    def release(self) -> None:
        """Free the lease at once (a clean exit), so the next scheduler need not wait."""
        if self.generation is None:
            return
        if not self.bucket.exists(self.keys.lease(self.generation + 1)):
            self.bucket.write_json(self.keys.lease(self.generation),
                                   self._record.model_copy(update={"released": True}).model_dump())
        self.generation = None

    def wait(self) -> None:
        """Hold the lease, waiting for the current holder to release it or let it expire."""
        said = None
        while True:
            try:
                return self.hold()
            except LeaseHeld as exc:
                if said is None:  # not the refusal's advice: this one is the standby
                    log.warning("run %s is scheduled by %s; waiting (standby) to take over when it ends",
                                self.keys.run, exc.holder or "another scheduler")
                said = exc
            self.clock.sleep(self.ttl_s / 6)


def holder_of(bucket: Bucket, keys: RunLayout, now: float) -> str | None:
    """Who schedules the run now, for ``dedloc status`` (None: no live lease)."""
    _, record = newest(bucket, keys)
    return describe(record, now) if held(record, now) else None
