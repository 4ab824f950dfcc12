"""Recomputing a shard: the validator's model, a shard's gradient on the samples it names, and
how far an honest shard may be from it.

A shard's gradient depends on its state, its samples and the machine; ``Recomputer`` redoes the
worker's computation (its first ``stale_samples`` on state r-1, the rest on state r),
``compare`` measures the distance (cosine, norm ratio) against the codec's ``Tolerance``, and
``similarities`` compares every pair of a round's shards chunk by chunk (``Pairs``: cosines, and
for sparse shards the overlap of the positions they kept), to find copies.
The tolerances and the detection rates behind them are measured by ``benchmarks/verify.py``
(docs/verification.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..model.data import make_source
from ..protocol.config import RunConfig
from ..protocol.run import Run, RunError
from ..protocol.shard import Entry
from ..storage import codec, vector
from ..storage.layout import volunteer_of

COPY_COSINE = 0.99  # a pair above it is recomputed; honest pairs measured up to 0.82
# sparse shards: a pair keeping this share of the same positions (Jaccard) is recomputed too;
# honest pairs measured up to 0.086, a copy 1.0 however its values are disguised
COPY_OVERLAP = 0.5


@dataclass(frozen=True)
class Tolerance:
    """How far an honest shard may be from its recomputation: the codec's rounding (with error
    feedback, the residual the volunteer carried in and the one it keeps), and float differences
    between machines (micro-batch sizes, CPU and GPU kernels)."""

    min_cosine: float
    max_norm_error: float | None  # |(|shard| / |recomputed|) - 1|; None: not checked
    kept_only: bool = False  # on the entries the shard kept only (a sparse shard's: below)
    # a shard that passes ``min_cosine`` but not ``pair_cosine`` is held against a shard of
    # another volunteer of its round (its copy pair, or a reference): ``short_of``. For sparse
    # shards, whose loose bound lets copies and work on other samples pass (kept entries'
    # cosines 0.63 to 0.88 early in a run)
    pair_cosine: float | None = None
    pair_spread: float = 5.0

    def short_of(self, cosine: float, reference: float) -> bool:
        """A shard's cosine with its replay is too far from that of a shard of another volunteer
        of its round (both replays see the same round and its volunteers' error feedback): below
        ``pair_cosine``, and ``pair_spread`` times as far from 1. Honest shards of one round
        drift from 1.0 together (to 0.944 in 20 rounds: no fixed bound holds), the least
        matching at most 3.9 times as far from 1 as the best (56 rounds of the tiny model, 8 a
        run); copies and work on other samples at least 6.4 times as far as the least matching
        honest shard of their round in those runs, less late in a run (docs/verification.md)."""
        return self.pair_cosine is not None and cosine < self.pair_cosine and \
            1 - cosine >= self.pair_spread * (1 - reference)

    def compare(self, shard: np.ndarray, recomputed: np.ndarray) -> Comparison:
        """``compare``, on the entries the shard kept if ``kept_only``."""
        if self.kept_only:
            kept = shard != 0
            shard, recomputed = shard[kept], recomputed[kept]
        return compare(shard, recomputed)


# Worst honest shard measured (benchmarks/verify.py, docs/verification.md), 1 - cosine and
# |norm ratio - 1|: none 1e-14 / 1e-8, fp16 1e-7 / 4e-5, int8 1.4e-3 / 1.8e-3, int4 0.12 / 0.17.
# Each bound is 10x or more the measured error (int4: about 2.5x; its rounding is as large as
# the differences between honest shards, so int4 shards are verified only coarsely).
TOLERANCES = {"none": Tolerance(0.99999, 0.001), "fp16": Tolerance(0.9999, 0.005),
              "int8": Tolerance(0.98, 0.05), "int4": Tolerance(0.7, 0.4)}
# diloco, pseudo-gradients replayed (benchmarks/verify.py, section 4), worst honest shard: none
# 1e-12 / 1e-7 (its bound above holds), int8 1.5e-5 / 4e-5 (far under its rounding of gradients:
# AdamW's steps are of even size), bf16 volunteers 7.3e-3 / 8e-4 (another micro-batch rounds
# bfloat16 sums otherwise). A sparse shard is its top 1/64 plus the volunteer's error feedback,
# never uploaded: only the direction of its kept entries is checked (honest at least 0.978).
REPLAY_TOLERANCES = {"int8": Tolerance(0.999, 0.01),
                     "sparse": Tolerance(0.5, None, kept_only=True, pair_cosine=0.99)}
BF16 = Tolerance(0.97, 0.01)


def tolerance(config: RunConfig, precision: str = "fp32") -> Tolerance:
    """How far an honest shard of a run with ``config``, computed in ``precision``, may be from
    its recomputation: the codec's; in diloco the replay's (the default algorithm's for a codec
    not measured there), loosened to bfloat16's rounding for a bf16 volunteer."""
    if config.algorithm != "diloco":
        return TOLERANCES[config.codec]
    tol = REPLAY_TOLERANCES.get(config.codec) or TOLERANCES[config.codec]
    if precision == "bf16":
        norm = None if tol.max_norm_error is None else max(tol.max_norm_error, BF16.max_norm_error)
        tol = replace(tol, min_cosine=min(tol.min_cosine, BF16.min_cosine), max_norm_error=norm)
    return tol


@dataclass(frozen=True)
class Comparison:
    cosine: float
    norm_ratio: float  # |shard| / |recomputed|

    def matches(self, tol: Tolerance) -> bool:
        return self.cosine >= tol.min_cosine and (tol.max_norm_error is None
                                                  or abs(self.norm_ratio - 1) <= tol.max_norm_error)


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
        self._locals: dict[str, object] = {}  # diloco: precision -> the replaying Accumulation

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
        ranges and its sample count, ``validation.max_claim``; these are the claims only a
        recomputation reads)."""
        if entry.stale_samples > entry.samples:
            raise Unverifiable(f"claims {entry.stale_samples} stale samples of {entry.samples}", fault=True)
        if entry.stale_samples and entry.round == 0:
            raise Unverifiable("claims stale samples in round 0: there is no earlier state", fault=True)

    def gradient(self, entry: Entry) -> np.ndarray:
        """What the shard should carry, done again: its mean gradient, or in the local-steps mode
        its pseudo-gradient (``replay``). The mean gradient: its first ``stale_samples`` samples
        on the state before its round's, the rest on its round's state, gradients summed over
        both as the worker sums them, then divided by the samples."""
        if self.run.config.algorithm == "diloco":
            return self.replay(entry)
        self.check_claim(entry)
        r, stream, stale = entry.round, entry.data.stream, entry.stale_samples
        indices = entry.data.indices()
        grad = self.summed(stream, [(r - 1, indices[:stale]), (r, indices[stale:])])
        grad /= entry.samples
        return grad

    def summed(self, stream: str, parts: list[tuple[int, list[int]]]) -> np.ndarray:
        """The loss gradient of samples of ``stream``, each part's ``(state, indices)`` on its
        state, summed over all of them (as a worker sums micro-batches)."""
        states = {s: self.params(s) for s, idx in parts if idx}  # all loaded before any compute
        self.model.zero_grad(set_to_none=False)
        for s, idx in parts:
            if not idx:
                continue
            self.flat.set(states[s])
            for lo in range(0, len(idx), self.micro_batch):
                for a, n in _runs(idx[lo:lo + self.micro_batch]):
                    self._backward(self.model, stream, a, n)
        return self.flat.grad()

    def replay(self, entry: Entry) -> np.ndarray:
        """A diloco shard's pseudo-gradient, made again as its worker made it, with the worker's
        own ``Accumulation`` (the inner step is written once): a fresh inner optimizer at state
        r, or at r-1 for the first ``stale_samples``, moved onto state r where they end
        (``rebase``); a step after each claimed ``inner_steps``, at the learning rate of the state
        it is taken on (a step shorter than ``inner_batch`` is the last, taken at the upload, on
        state r); then state r minus the local parameters, in the volunteer's precision."""
        cfg = self.run.config
        if cfg.inner_state != "shard":
            raise Unverifiable("inner_state kept: a diloco shard then depends on the volunteer's inner optimizer "
                               "state (never uploaded): only its claims and direction are checked", fault=False)
        if not entry.inner_steps:
            raise Unverifiable("no inner steps listed: nothing to replay", fault=False)
        self.check_claim(entry)
        steps, r, stream, stale = entry.inner_steps, entry.round, entry.data.stream, entry.stale_samples
        if sum(steps) != entry.samples or min(steps) < 1:
            raise Unverifiable(f"inner steps {steps} for {entry.samples} samples", fault=True)
        states = {s: self.params(s) for s in ((r - 1, r) if stale else (r,))}  # both loaded before any compute
        local = self._local(entry.precision)
        local.drop(states[min(states)])
        on = min(states)  # the state the worker was on
        indices = entry.data.indices()

        train = functools.partial(self._backward, local.model, stream)

        def arrive() -> None:  # state r, once: the inner steps so far move with it
            nonlocal on
            if on < r:
                local.rebase(states[r])
                on = r

        done = 0
        for i, k in enumerate(steps):
            cuts = sorted({*range(done, done + k, self.micro_batch), done + k}
                          | ({stale} if done < stale < done + k else set()))
            for lo, hi in zip(cuts, cuts[1:]):
                if lo >= stale:
                    arrive()
                for a, n in _runs(indices[lo:hi]):
                    local.cursor = a
                    local.compute(r, n, train, stale=on < r)
            done += k
            if i == len(steps) - 1 and k < cfg.inner_batch:
                arrive()
            local.inner_step(on)
        arrive()
        return local.update(r)

    def _backward(self, model, stream: str, start: int, n: int) -> float:
        """Forward and backward on samples ``start`` to ``start + n`` of ``stream``, summed into
        ``model``'s gradients as a worker sums them; the summed loss."""
        from ..model.families import loss_sum

        loss = loss_sum(model, {k: v.to(self.device) for k, v in self.source.batch(stream, start, n).items()})
        loss.backward()
        return loss.item()

    def _local(self, precision: str):
        """The worker's ``Accumulation`` on a model of this machine in ``precision``, made once."""
        if precision not in self._locals:
            import torch

            from ..compute.accumulator import Accumulation

            model = self.model if precision == "fp32" else self.run.build_model().to(self.device, torch.bfloat16)
            self._locals[precision] = Accumulation(model, self.run.config)
        return self._locals[precision]


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
    """A shard's gradient as the round's mean used it: its frozen copy (``validation.freeze``), checked
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


@dataclass(frozen=True)
class Pairs:
    """Every pair of a round's shards: the cosine of their gradients, and for sparse shards the
    overlap of the positions they kept (Jaccard: shared over either's), NaN where a shard could
    not be read. A copy disguised by other values at the same positions keeps its overlap."""

    cosine: np.ndarray
    overlap: np.ndarray | None  # None: a dense codec, every shard keeps every position

    def suspects(self, entries: list[Entry], copy_cosine: float = COPY_COSINE,
                 copy_overlap: float | None = COPY_OVERLAP) -> list[tuple[int, int]]:
        """Pairs (i, j) of shards of different volunteers whose gradients are nearly identical,
        or (``copy_overlap``, None: not screened) whose kept positions nearly are."""
        out = []
        for i in range(len(entries)):
            for j in range(i + 1, len(entries)):
                if volunteer_of(entries[i].peer) == volunteer_of(entries[j].peer):
                    continue
                if self.cosine[i, j] >= copy_cosine or (copy_overlap is not None and self.overlap is not None
                                                        and self.overlap[i, j] >= copy_overlap):
                    out.append((i, j))
        return out


def similarities(run: Run, entries: list[Entry]) -> Pairs:
    """Every pair of shards compared (``Pairs``), from sums chunk by chunk: one chunk of every
    shard in memory at a time, never all shards whole. A shard that cannot be read (pruned,
    damaged) has NaN for every pair: it screens nobody, and the others are still screened."""
    fmt, k = run.grad_format, len(entries)
    sparse = fmt.codec == "sparse"
    gram, shared = np.zeros((k, k)), np.zeros((k, k))
    unreadable = np.zeros(k, bool)
    for c in range(fmt.n_chunks):
        found = vector.read_vectors(run.bucket, [run.keys.frozen(e.key) for e in entries], fmt, range(c, c + 1),
                                    [e.checksums for e in entries])
        unreadable |= [isinstance(a, vector.CorruptShard) for a in found]
        x = np.stack([np.zeros(fmt.elements(range(c, c + 1))) if unreadable[i] else
                      codec.decode(a, fmt.codec, fmt.block, fmt.elements(range(c, c + 1)))
                      for i, a in enumerate(found)]).astype(np.float64)
        gram += x @ x.T
        if sparse:
            kept = (x != 0).astype(np.float64)
            shared += kept @ kept.T
    norms = np.sqrt(np.clip(np.diag(gram), 1e-300, None))
    cos = gram / np.outer(norms, norms)
    cos[unreadable, :] = cos[:, unreadable] = np.nan
    if not sparse:
        return Pairs(cos, None)
    either = np.add.outer(np.diag(shared), np.diag(shared)) - shared
    overlap = shared / np.clip(either, 1, None)
    overlap[unreadable, :] = overlap[:, unreadable] = np.nan
    return Pairs(cos, overlap)
