"""Storage faults on purpose, for the fault matrix (tests/test_faults.py) and the soak with
faults (benchmarks/soak_faults.py): a share of requests fails before it reaches the bucket, or
times out after it took effect (the reply is lost); a full disk fails every write with ENOSPC;
both for stretches of requests (``Stretches``); and a process dies at a chosen request (SIGKILL:
nothing it does afterwards reaches the bucket). Injected both in the Bucket's fsspec filesystem
and in its zarr stores, so every path a request can take meets them."""

from __future__ import annotations

import errno
import functools
import random
import threading
from collections import Counter

import zarr

from .storage.bucket import Bucket
from .storage.retry import RetryPolicy

WRITES = {"pipe_file", "set"}  # the requests that need space on a disk (a rename or link does not)


class Killed(BaseException):
    """The process died at this request: a BaseException, so no retry and no ``except Exception``
    in the code under test goes on from it, as nothing goes on from a SIGKILL."""


class Faults:
    """The faults every request of the processes sharing it meets: ``rate`` of them fail, half
    before reaching the bucket and half after taking effect; while ``full``, every write fails
    with ENOSPC before it lands. Both may change while the processes run (the soak's stretches)."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate, self.full, self._rng, self._lock = rate, False, random.Random(seed), threading.Lock()
        self.requests, self.injected = 0, Counter()

    def _roll(self, op: str) -> float:
        with self._lock:
            self.requests += 1
            roll = self._rng.random()
            if self.full and op in WRITES:
                self.injected["full"] += 1
                raise OSError(errno.ENOSPC, f"injected: {op}: no space left on device")
            if roll < self.rate / 2:
                self.injected["before"] += 1
                raise ConnectionResetError(f"injected: {op} failed")
        return roll

    def _lost(self, op: str, roll: float) -> None:
        if roll < self.rate:
            with self._lock:
                self.injected["after"] += 1
            raise TimeoutError(f"injected: {op} timed out after it took effect")

    def call(self, op: str, fn, *a, **kw):
        roll = self._roll(op)
        out = fn(*a, **kw)
        self._lost(op, roll)
        return out

    async def acall(self, op: str, fn, *a, **kw):
        roll = self._roll(op)
        out = await fn(*a, **kw)
        self._lost(op, roll)
        return out


class Stretches:
    """``faults`` changing over the bucket's requests: healthy, then failing at a rate (half
    before, half after taking effect) or the disk full, then healthy again, each stretch's kind,
    rate and length drawn from ``rng`` (the soak with faults)."""

    def __init__(self, faults: Faults, rng: random.Random):
        self.faults, self.rng, self.kind = faults, rng, "healthy"
        self.until, self.counts = rng.randint(1000, 4000), Counter()  # stretches by kind

    def update(self) -> None:
        """The next stretch, once the current one's requests are done (called between steps)."""
        f = self.faults
        if f.requests < self.until:
            return
        if self.kind != "healthy":
            self.kind, f.rate, f.full, n = "healthy", 0.0, False, self.rng.randint(2000, 8000)
        elif self.rng.random() < 0.4:
            self.kind, f.full, n = "full", True, self.rng.randint(5, 60)
        else:
            self.kind, f.rate, n = "flaky", self.rng.choice((0.05, 0.1, 0.2, 0.3)), self.rng.randint(200, 2000)
        if self.kind != "healthy":
            self.counts[self.kind] += 1
        self.until = f.requests + n


class Kill:
    """One process's requests, counted (``requests``): once ``arm(k)``-ed, its k-th request from
    then on and every one after raise Killed, in all its threads (a SIGKILL ends them all)."""

    def __init__(self, name: str):
        self.name, self.requests, self._at, self._lock = name, 0, None, threading.Lock()
        self.dead = False

    def arm(self, after: int) -> None:
        with self._lock:
            self._at = self.requests + max(1, after)

    def disarm(self) -> None:
        with self._lock:
            self._at = None

    def now(self) -> None:
        """Die at once: every further request raises Killed (a process that vanished)."""
        with self._lock:
            self.dead = True

    def check(self, op: str) -> None:
        with self._lock:
            self.requests += 1
            self.dead = self.dead or (self._at is not None and self.requests >= self._at)
        if self.dead:
            raise Killed(f"{self.name} killed at {op}")


class _Meet:
    """What one request of a process meets: its kill switch, then the shared faults (a Faults
    alone serves where no process dies)."""

    def __init__(self, faults: Faults, kill: Kill | None):
        self.faults, self.kill = faults, kill

    def call(self, op: str, fn, *a, **kw):
        if self.kill is not None:
            self.kill.check(op)
        return self.faults.call(op, fn, *a, **kw)

    async def acall(self, op: str, fn, *a, **kw):
        if self.kill is not None:
            self.kill.check(op)
        return await self.faults.acall(op, fn, *a, **kw)


class FaultyFS:
    """An fsspec filesystem whose requests meet ``meet`` (a Faults, or a process's _Meet)."""

    OPS = {"cat_file", "cat", "pipe_file", "exists", "ls", "find", "rm", "mv", "link", "makedirs"}

    def __init__(self, fs, meet: Faults | _Meet):
        self._fs, self._meet = fs, meet

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        return functools.partial(self._meet.call, name, attr) if name in self.OPS else attr


class FaultyStore(zarr.storage.WrapperStore):
    """A zarr store whose requests meet ``meet`` (a Faults, or a process's _Meet)."""

    def __init__(self, store, meet: Faults | _Meet):
        super().__init__(store)
        self.meet = meet

    def _with_store(self, store):
        return type(self)(store, self.meet)

    async def get(self, key, prototype, byte_range=None):
        return await self.meet.acall("get", self._store.get, key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        return await self.meet.acall("get", self._store.get_partial_values, prototype, key_ranges)

    async def set(self, key, value):
        return await self.meet.acall("set", self._store.set, key, value)

    async def exists(self, key):
        return await self.meet.acall("exists", self._store.exists, key)

    async def delete(self, key):
        return await self.meet.acall("delete", self._store.delete, key)


def inject(bucket: Bucket, faults: Faults, kill: Kill | None = None,
           retry: RetryPolicy = RetryPolicy(attempts=10, wait_s=0.001, max_wait_s=0.01)) -> Bucket:
    """Faults below the bucket's retries (``retry``: by default a millisecond's wait, not 0.2 s)."""
    meet = _Meet(faults, kill)
    bucket.fs = FaultyFS(bucket.fs, meet)
    store = bucket._store
    bucket._store = lambda key: FaultyStore(store(key), meet)
    bucket.retry = retry
    return bucket
