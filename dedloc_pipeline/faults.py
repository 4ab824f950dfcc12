"""Storage faults on purpose: a share of requests fails before it reaches the bucket, or times
out after it took effect (the reply is lost), both in the Bucket's fsspec filesystem and in its
zarr stores, so every path a request can take meets them."""

from __future__ import annotations

import functools
import random
import threading
from collections import Counter

import zarr

from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.retry import RetryPolicy


class Faults:
    def __init__(self, rate: float, seed: int = 0):
        self.rate, self._rng, self._lock = rate, random.Random(seed), threading.Lock()
        self.requests, self.injected = 0, Counter()

    def _roll(self, op: str) -> float:
        with self._lock:
            self.requests += 1
            roll = self._rng.random()
        if roll < self.rate / 2:
            self.injected["before"] += 1
            raise ConnectionResetError(f"injected: {op} failed")
        return roll

    def _lost(self, op: str, roll: float) -> None:
        if roll < self.rate:
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


class FaultyFS:
    """An fsspec filesystem whose requests meet ``faults``."""

    OPS = {"cat_file", "cat", "pipe_file", "exists", "ls", "find", "rm", "mv", "link", "makedirs"}

    def __init__(self, fs, faults: Faults):
        self._fs, self._faults = fs, faults

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        return functools.partial(self._faults.call, name, attr) if name in self.OPS else attr


class FaultyStore(zarr.storage.WrapperStore):
    """A zarr store whose requests meet ``faults``."""

    def __init__(self, store, faults: Faults):
        super().__init__(store)
        self.faults = faults

    def _with_store(self, store):
        return type(self)(store, self.faults)

    async def get(self, key, prototype, byte_range=None):
        return await self.faults.acall("get", self._store.get, key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        return await self.faults.acall("get", self._store.get_partial_values, prototype, key_ranges)

    async def set(self, key, value):
        return await self.faults.acall("set", self._store.set, key, value)

    async def exists(self, key):
        return await self.faults.acall("exists", self._store.exists, key)

    async def delete(self, key):
        return await self.faults.acall("delete", self._store.delete, key)


def inject(bucket: Bucket, faults: Faults) -> Bucket:
    """Faults below the bucket's retries (which wait a millisecond, not the default 0.2 s)."""
    bucket.fs = FaultyFS(bucket.fs, faults)
    store = bucket._store
    bucket._store = lambda key: FaultyStore(store(key), faults)
    bucket.retry = RetryPolicy(attempts=10, wait_s=0.001, max_wait_s=0.01)
    return bucket
