"""The loss screen of the local-steps mode: does a shard descend the loss of its own samples?

A diloco shard is a pseudo-gradient: where its volunteer's inner steps on the samples it claims
started minus where they took the model. To first order an honest one points along those
samples' loss gradient where the steps on them started: state r, or r-1 for the stale samples
computed while r was reduced (at r, after the outer step on r-1's shards, their gradient may
point back, and in every other round of a ``tiny`` run it did). So as validation reads each
shard the scheduler takes that gradient on ``close.probe_samples`` of the shard's claimed
samples, drawn with a secret of this process (a volunteer cannot know which to train on), and
its cosine with the shard over the entries the shard carries (all, or a sparse shard's kept
ones). A random direction's cosine spreads as 1/sqrt(entries), so the cosine is read in those
units (``descent``), and a shard below ``close.min_descent`` is rejected: reversed shards score
far below zero, noise within a few units of it, honest shards 3 to hundreds above
(docs/diloco.md, docs/verification.md).
The first-order change, on the shard's own samples, not the loss after the step or on held-out
samples: applied alone, an honest shard may overshoot (in a ``tiny`` run every volunteer's shard
of one round raised the held-out loss by 0.4 to 0.5), but it never points away from the samples
it fits. Cost: a forward and backward pass on those samples per shard; no request but the
states' snapshots once a round and the data blocks holding the samples.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading

import numpy as np

from ..protocol.run import Run
from ..protocol.shard import Entry, Rejected
from .recompute import Recomputer

_SECRET = os.urandom(16)  # which claimed samples are scored is nobody else's to know


class LossProbe:
    """The run's model in the scheduler's process (on its GPU if it has one) and the states of the
    round being judged and the one before, as the validator holds them (``Recomputer``); one
    shard at a time: validation runs in threads."""

    def __init__(self, run: Run, samples: int) -> None:
        self.run, self.samples = run, samples
        self._recomputer: Recomputer | None = None  # the validator's model and states, made at first use
        self._lock = threading.Lock()

    def drawn(self, entry: Entry) -> list[int]:
        """Which of a shard's claimed samples it is scored on (positions in its claim, in
        order): ``samples`` of them, drawn by the secret and the shard's key."""
        n = entry.samples
        if n <= self.samples:
            return list(range(n))
        seed = int.from_bytes(hashlib.sha256(_SECRET + entry.key.encode()).digest()[:8], "little")
        return sorted(np.random.default_rng(seed).choice(n, self.samples, replace=False).tolist())

    def descent(self, entry: Entry, update: np.ndarray) -> float:
        """How far the shard's round's state minus ``update`` goes down the loss of its drawn
        samples: the cosine of ``update`` with their gradient, over its nonzero entries, times the
        square root of their number (a random direction's: about -1 to 1). Each sample's
        gradient is taken where the volunteer's inner steps on it started: the first
        ``stale_samples`` on the state before (then moved with the steps), the rest on the
        round's. 0 for no update."""
        carried = np.flatnonzero(update)
        if carried.size == 0:
            return 0.0
        r, stale = entry.round, entry.stale_samples
        if stale and r == 0:
            raise Rejected("claims stale samples in round 0: there is no earlier state")
        claimed = entry.data.indices()
        drawn = self.drawn(entry)
        parts = [(r - 1, [claimed[j] for j in drawn if j < stale]), (r, [claimed[j] for j in drawn if j >= stale])]
        with self._lock:
            if self._recomputer is None:
                self._recomputer = Recomputer(self.run)
            grad = self._recomputer.summed(entry.data.stream, parts)[carried].astype(np.float64)
        u = update[carried].astype(np.float64)
        norms = float(np.linalg.norm(grad) * np.linalg.norm(u))
        return float(grad @ u) / norms * math.sqrt(carried.size) if norms > 0 else 0.0
