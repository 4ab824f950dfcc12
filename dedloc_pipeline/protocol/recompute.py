"""Recomputing a shard: the validator's model, a shard's gradient on the samples it names, and
how far an honest shard may be from it.

A shard's gradient depends on its state, its samples and the machine; ``Recomputer`` redoes the
worker's computation (its first ``stale_samples`` on state r-1, the rest on state r),
``compare`` measures the distance (cosine, norm ratio) against the codec's ``Tolerance``, and
``similarities`` finds near-identical shards of different volunteers (copies) chunk by chunk.
The tolerances and the detection rates behind them are measured by ``benchmarks/verify.py``
(docs/verification.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..model.data import make_source
from ..storage import codec, vector
from ..storage.layout import volunteer_of
from .run import Run, RunError
from .shard import Entry

COPY_COSINE = 0.99  # a pair above it is recomputed; honest pairs measured up to 0.82


@dataclass(frozen=True)
class Tolerance:
    """How far an honest shard may be from its recomputation: the codec's rounding (with error
    feedback, the residual the volunteer carried in and the one it keeps), and float differences
    between machines (micro-batch sizes, CPU and GPU kernels)."""

    min_cosine: float
    max_norm_error: float  # |(|shard| / |recomputed|) - 1|


# Worst honest shard measured (benchmarks/verify.py, docs/verification.md), 1 - cosine and
# |norm ratio - 1|: none 1e-14 / 1e-8, fp16 1e-7 / 4e-5, int8 1.4e-3 / 1.8e-3, int4 0.12 / 0.17.
# Each bound is 10x or more the measured error (int4: about 2.5x; its rounding is as large as
# the differences between honest shards, so int4 shards are verified only coarsely).
TOLERANCES = {"none": Tolerance(0.99999, 0.001), "fp16": Tolerance(0.9999, 0.005),
              "int8": Tolerance(0.98, 0.05), "int4": Tolerance(0.7, 0.4)}


@dataclass(frozen=True)
class Comparison:
    cosine: float
    norm_ratio: float  # |shard| / |recomputed|

    def matches(self, tol: Tolerance) -> bool:
        return self.cosine >= tol.min_cosine and abs(self.norm_ratio - 1) <= tol.max_norm_error


def compare(shard: np.ndarray, recomputed: np.ndarray) -> Comparison:
    """Cosine and norm ratio, in float64 (a zero vector's cosine is 0: it matches nothing else)."""
    a, b = shard.astype(np.float64), recomputed.astype(np.float64)
    na, nb = math.sqrt(a @ a), math.sqrt(b @ b)
    if na == 0 or nb == 0:
        same = na == nb
        return Comparison(cosine=1.0 if same else 0.0, norm_ratio=1.0 if same else math.inf if nb == 0 else 0.0)
    return Comparison(cosine=float(a @ b) / (na * nb), norm_ratio=na / nb)


class Unverifiable(RuntimeError):
    """A shard that cannot be recomputed; ``fault``: its claim is why; ``pruned``: what it needs
    is no longer in the bucket (the round is skipped, not held against anyone)."""

    def __init__(self, reason: str, fault: bool, pruned: bool = False):
        super().__init__(reason)
        self.fault, self.pruned = fault, pruned


class Recomputer:
    """The run's model on this machine, and the states it has loaded (kept in memory: a state
    loaded before it is pruned stays usable)."""

    def __init__(self, run: Run, device: str | None = None, micro_batch: int | None = None, keep: int = 3):
        import torch

        from ..model.flat import FlatLayout

        self.run, self.keep = run, keep
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = run.build_model().to(self.device)
        self.flat = FlatLayout(self.model)
        self.micro_batch = micro_batch or run.config.micro_batch
        self.source = make_source(run)  # no owner: it never claims data blocks
        self._states: dict[int, np.ndarray] = {}

    def params(self, s: int) -> np.ndarray:
        """State s's parameters; Unverifiable (not the volunteer's fault) once it is pruned."""
        if s in self._states:
            self._states[s] = self._states.pop(s)  # the most recently used last
        else:
            try:
                self._states[s] = self.run.load_params(s)
            except (vector.CorruptShard, RunError) as exc:
                raise Unverifiable(f"state {s} is no longer in the bucket (pruned): {exc}",
                                   fault=False, pruned=True) from exc
            while len(self._states) > self.keep:
                del self._states[next(iter(self._states))]
        return self._states[s]

    def check_claim(self, entry: Entry) -> None:
        """What a shard says of its samples must be possible (validation at close bounds its
        ranges and its sample count, ``shard.max_claim``; these are the claims only a
        recomputation reads)."""
        if entry.stale_samples > entry.samples:
            raise Unverifiable(f"claims {entry.stale_samples} stale samples of {entry.samples}", fault=True)
        if entry.stale_samples and entry.round == 0:
            raise Unverifiable("claims stale samples in round 0: there is no earlier state", fault=True)

    def gradient(self, entry: Entry) -> np.ndarray:
        """The shard's mean gradient recomputed: its first ``stale_samples`` samples on the state
        before its round's, the rest on its round's state, gradients summed over both as the
        worker sums them, then divided by the samples."""
        if self.run.config.algorithm == "diloco":
            raise Unverifiable("a diloco shard is where the volunteer's inner steps went, which depends on its "
                               "inner optimizer state (never uploaded): only its claims and norm are checked",
                               fault=False)
        from ..model.families import loss_sum

        self.check_claim(entry)
        r, stream, stale = entry.round, entry.data.stream, entry.stale_samples
        indices = [i for start, count in entry.data.ranges for i in range(start, start + count)]
        parts = [(r - 1, indices[:stale]), (r, indices[stale:])]
        states = {s: self.params(s) for s, idx in parts if idx}  # both loaded before any compute
        self.model.zero_grad(set_to_none=False)
        for s, idx in parts:
            if not idx:
                continue
            self.flat.set(states[s])
            for lo in range(0, len(idx), self.micro_batch):
                run_ = _runs(idx[lo:lo + self.micro_batch])
                batches = [self.source.batch(stream, a, n) for a, n in run_]
                for batch in batches:
                    loss = loss_sum(self.model, {k: v.to(self.device) for k, v in batch.items()})
                    loss.backward()
        grad = self.flat.grad()
        grad /= entry.samples
        return grad


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive indices as (first, count) runs."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return [(a, n) for a, n in out]


def read_shard(run: Run, entry: Entry) -> np.ndarray:
    """A shard's gradient as the round's mean used it: its frozen copy (``shard.freeze``), checked
    against its CLOSE entry. Its volunteer cannot write there, so a copy gone is pruned and one
    that fails its checksums was changed by whoever holds the organizer's credentials."""
    fmt, frozen = run.grad_format, run.keys.frozen(entry.key)
    try:
        arrays = vector.read_vector(run.bucket, frozen, fmt, checksums=entry.checksums, raw=True)
    except vector.CorruptShard as exc:
        if run.bucket.sizes(frozen):
            raise Unverifiable(f"its frozen copy changed after validation: {exc}", fault=False) from exc
        raise Unverifiable(f"the shard is no longer in the bucket (pruned): {exc}", fault=False, pruned=True) from exc
    return codec.decode(arrays, fmt.codec, fmt.block, fmt.n)


def similarities(run: Run, entries: list[Entry]) -> np.ndarray:
    """The cosine of every pair of shards, from dot products summed chunk by chunk: one chunk of
    every shard in memory at a time, never all shards whole. A shard that cannot be read (pruned,
    damaged) has NaN for every cosine: it screens nobody, and the others are still screened."""
    fmt, k = run.grad_format, len(entries)
    gram = np.zeros((k, k))
    unreadable = np.zeros(k, bool)
    for c in range(fmt.n_chunks):
        found = vector.read_vectors(run.bucket, [run.keys.frozen(e.key) for e in entries], fmt, range(c, c + 1),
                                    [e.checksums for e in entries])
        unreadable |= [isinstance(a, vector.CorruptShard) for a in found]
        x = np.stack([np.zeros(fmt.elements(range(c, c + 1))) if unreadable[i] else
                      codec.decode(a, fmt.codec, fmt.block, fmt.elements(range(c, c + 1)))
                      for i, a in enumerate(found)]).astype(np.float64)
        gram += x @ x.T
    norms = np.sqrt(np.clip(np.diag(gram), 1e-300, None))
    cos = gram / np.outer(norms, norms)
    cos[unreadable, :] = cos[:, unreadable] = np.nan
    return cos


def copy_suspects(entries: list[Entry], cosines: np.ndarray, threshold: float = COPY_COSINE) -> list[tuple[int, int]]:
    """Pairs (i, j) of shards of different volunteers whose gradients are nearly identical."""
    out = []
    for i in range(len(entries)):
        for j in range(i + 1, len(entries)):
            if volunteer_of(entries[i].peer) != volunteer_of(entries[j].peer) and cosines[i, j] >= threshold:
                out.append((i, j))
    return out
