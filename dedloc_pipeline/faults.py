"""Storage faults on purpose, for the fault matrix (tests/test_faults.py) and the soak with
faults (benchmarks/soak_faults.py): a share of requests fails before it reaches the bucket, or
times out after it took effect (the reply is lost); a full disk fails every write with ENOSPC;
both for stretches of a run's steps (``Stretches``); and a process dies at a chosen request
(SIGKILL: nothing it does afterwards reaches the bucket). Injected both in the Bucket's fsspec
filesystem and in its zarr stores, so every path a request can take meets them.

Which requests fail is a function of the seed and of each request alone: who makes it (the
process), what it is (the operation and the keys it names) and how many times that process made
it before. Not of the order the requests arrive in: the processes' threads (the scheduler's
parts and its judge's reads, a volunteer's transfer thread, zarr's concurrent chunk I/O)
interleave differently with every run and every load, and a fault drawn in arrival order, from
one generator, went to a different request each time: a run's retries, failures and restarts
changed with the machine's load."""

from __future__ import annotations

import errno
import hashlib
import random
import re
import threading
from collections import Counter

import zarr

from .storage import part
from .storage.bucket import Bucket
from .storage.retry import RetryPolicy

WRITES = {"pipe_file", "set"}  # the requests that need space on a disk (a rename or link does not)
_TMP = re.compile(r"/\.[0-9a-f]{8}\.")  # Bucket._local_tmp's random infix: /.{8 hex}.{name}
_PART = re.compile(rf"\b(\d{{{part.MS_DIGITS}}})-[0-9a-f]{{{part.TOKEN_HEX}}}\b")  # part.name: ms, a token


def _named(args, root: str = "") -> str:
    """What a filesystem request names: its paths (and lists of them), under the bucket's root
    (a temporary folder, another each run). Its data and options are not named."""
    out = []
    for a in args:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, str):
                out.append(x[len(root):] if root and x.startswith(root) else x)
    return "|".join(out)


class Killed(BaseException):
    """The process died at this request: a BaseException, so no retry and no ``except Exception``
    in the code under test goes on from it, as nothing goes on from a SIGKILL."""


class Faults:
    """The faults every request of the processes sharing it meets: ``rate`` of them fail, half
    before reaching the bucket and half after taking effect; while ``full``, every write fails
    with ENOSPC before it lands. Both may change while the processes run (the soak's stretches).

    A request's roll comes from the seed, who makes it (``who``: a process's name), the operation,
    what it names, and how many times the same process made the same request before (so a retry
    rolls again), never from the order in which the requests of all processes and threads arrive
    (but for two threads of one process making the very same request at once: they may swap rolls).
    What a request names is taken as the same in every run: a temporary file's random infix is
    left out, and a part's name is the time since ``epoch`` (the run's clock at its start) it was
    made at, in hundredths of a second (its milliseconds, truncated from another epoch each run,
    may differ by one), without its random token."""

    def __init__(self, rate: float, seed: int = 0, epoch: float = 0.0):
        self.rate, self.full, self.seed, self.epoch, self._lock = rate, False, seed, epoch, threading.Lock()
        self.requests, self.injected = 0, Counter()
        self._made: Counter[tuple[str, str, str]] = Counter()  # (who, op, named) -> times made so far

    def _same(self, named: str) -> str:
        """``named`` as it is in every run of the same seed."""
        named = _TMP.sub("/.tmp.", named)
        return _PART.sub(lambda m: f"part@{round(int(m.group(1)) / 10 - self.epoch * 100)}", named)

    def _roll(self, op: str, named: str, who: str) -> float:
        named = self._same(named)
        with self._lock:
            self.requests += 1
            n = self._made[who, op, named]
            self._made[who, op, named] = n + 1
            if self.full and op in WRITES:
                self.injected["full"] += 1
                raise OSError(errno.ENOSPC, f"injected: {op}: no space left on device")
        h = hashlib.blake2b(f"{self.seed}\0{who}\0{op}\0{named}\0{n}".encode(), digest_size=8).digest()
        roll = int.from_bytes(h, "big") / 2.0 ** 64  # uniform in [0, 1)
        if roll < self.rate / 2:
            with self._lock:
                self.injected["before"] += 1
            raise ConnectionResetError(f"injected: {op} failed")
        return roll

    def _lost(self, op: str, roll: float) -> None:
        if roll < self.rate:
            with self._lock:
                self.injected["after"] += 1
            raise TimeoutError(f"injected: {op} timed out after it took effect")

    def call(self, op: str, named: str, fn, *a, who: str = "", **kw):
        """``fn(*a, **kw)``, request ``op`` naming ``named``, by ``who``, meeting the faults."""
        roll = self._roll(op, named, who)
        out = fn(*a, **kw)
        self._lost(op, roll)
        return out

    async def acall(self, op: str, named: str, fn, *a, who: str = "", **kw):
        roll = self._roll(op, named, who)
        out = await fn(*a, **kw)
        self._lost(op, roll)
        return out


class Stretches:
    """``faults`` changing over the steps of a run (``update`` once a step): healthy, then failing
    at a rate (half before, half after taking effect) or the disk full, then healthy again, each
    stretch's kind, rate and length in steps drawn from ``rng`` (the soak with faults: a step is a
    tick, a fake second). Counted in steps, not in requests: how many requests a step makes
    depends on the faults it met (retries) and on where a kill fell among a process's threads, so
    a stretch counted in requests began and ended at other steps in every run."""

    FIRST, HEALTHY, FLAKY, FULL = (10, 40), (20, 80), (2, 20), (1, 2)  # steps
    RATES = (0.05, 0.1, 0.2, 0.3)

    def __init__(self, faults: Faults, rng: random.Random):
        self.faults, self.rng, self.kind, self.steps = faults, rng, "healthy", 0
        self.until, self.counts = rng.randint(*self.FIRST), Counter()  # stretches by kind

    def update(self) -> None:
        """This step's stretch: the next one once the current one's steps are done (called
        before each step)."""
        f, self.steps = self.faults, self.steps + 1
        if self.steps <= self.until:
            return
        if self.kind != "healthy":
            self.kind, f.rate, f.full, n = "healthy", 0.0, False, self.rng.randint(*self.HEALTHY)
        elif self.rng.random() < 0.4:
            self.kind, f.full, n = "full", True, self.rng.randint(*self.FULL)
        else:
            self.kind, f.rate, n = "flaky", self.rng.choice(self.RATES), self.rng.randint(*self.FLAKY)
        if self.kind != "healthy":
            self.counts[self.kind] += 1
        self.until = self.steps - 1 + n


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
    """What one request of a process meets: its kill switch, then the shared faults, as that
    process's (a Faults alone serves where no process dies, as nobody's)."""

    def __init__(self, faults: Faults, kill: Kill | None):
        self.faults, self.kill = faults, kill
        self.who = kill.name if kill is not None else ""

    def call(self, op: str, named: str, fn, *a, **kw):
        if self.kill is not None:
            self.kill.check(op)
        return self.faults.call(op, named, fn, *a, who=self.who, **kw)

    async def acall(self, op: str, named: str, fn, *a, **kw):
        if self.kill is not None:
            self.kill.check(op)
        return await self.faults.acall(op, named, fn, *a, who=self.who, **kw)


class FaultyFS:
    """An fsspec filesystem whose requests meet ``meet`` (a Faults, or a process's _Meet);
    ``root``, the bucket's, is left out of what they name."""

    OPS = {"cat_file", "cat", "pipe_file", "exists", "ls", "find", "rm", "mv", "link", "makedirs"}

    def __init__(self, fs, meet: Faults | _Meet, root: str = ""):
        self._fs, self._meet, self._root = fs, meet, root

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if name not in self.OPS:
            return attr
        return lambda *a, **kw: self._meet.call(name, _named(a, self._root), attr, *a, **kw)


class FaultyStore(zarr.storage.WrapperStore):
    """A zarr store whose requests meet ``meet`` (a Faults, or a process's _Meet); ``prefix``,
    the key it is rooted at in the bucket, names its requests with their keys."""

    def __init__(self, store, meet: Faults | _Meet, prefix: str = ""):
        super().__init__(store)
        self.meet, self.prefix = meet, prefix

    def _with_store(self, store):
        return type(self)(store, self.meet, self.prefix)

    def _named(self, key: str, byte_range=None) -> str:
        return f"{self.prefix}/{key}" if byte_range is None else f"{self.prefix}/{key}@{byte_range!r}"

    async def get(self, key, prototype, byte_range=None):
        return await self.meet.acall("get", self._named(key, byte_range), self._store.get, key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        named = "|".join(self._named(k, r) for k, r in key_ranges)
        return await self.meet.acall("get", named, self._store.get_partial_values, prototype, key_ranges)

    async def set(self, key, value):
        return await self.meet.acall("set", self._named(key), self._store.set, key, value)

    async def exists(self, key):
        return await self.meet.acall("exists", self._named(key), self._store.exists, key)

    async def delete(self, key):
        return await self.meet.acall("delete", self._named(key), self._store.delete, key)


def inject(bucket: Bucket, faults: Faults, kill: Kill | None = None,
           retry: RetryPolicy = RetryPolicy(attempts=10, wait_s=0.001, max_wait_s=0.01)) -> Bucket:
    """Faults below the bucket's retries (``retry``: by default a millisecond's wait, not 0.2 s)."""
    meet = _Meet(faults, kill)
    bucket.fs = FaultyFS(bucket.fs, meet, getattr(bucket, "root", ""))
    store = bucket._store
    bucket._store = lambda key: FaultyStore(store(key), meet, key)
    bucket.retry = retry
    return bucket
