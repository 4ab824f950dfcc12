"""One run in a bucket: its config, its committed states, and how the flat vector is cut."""

from __future__ import annotations

import logging
import time
from functools import cached_property

import numpy as np

from ..model.data import SYNTHETIC, check_data, unigram_log_probs
from ..model.presets import seq_len_of
from ..storage import codec
from ..storage.bucket import Bucket
from ..storage.codec import VectorFormat
from ..storage.layout import LAYOUT_VERSION, RunLayout
from .config import RunConfig

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A run that cannot be used as asked (missing, incompatible, inconsistent)."""


class Run:
    def __init__(self, bucket: Bucket, name: str, config: RunConfig | None = None):
        self.bucket, self.keys = bucket, RunLayout(name)
        if config is None:
            try:
                raw = bucket.read_json(self.keys.config)
            except ValueError as exc:
                raise RunError(f"run {name!r}: run.json is not valid JSON ({exc})") from exc
            if raw is None:
                raise RunError(f"no run {name!r} in {bucket.url} (create it with `dedloc init`)")
            if raw.get("layout_version") != LAYOUT_VERSION:
                raise RunError(f"run {name!r} uses bucket layout v{raw.get('layout_version')}; "
                               f"this dedloc reads v{LAYOUT_VERSION}: nothing was written")
            config = RunConfig.model_validate(raw)
        self.config = config
        self.pruned_through: int | None = None  # the newest state this process pruned (scheduler.prune)

    @property
    def name(self) -> str:
        return self.config.run

    @property
    def seq_len(self) -> int:
        return seq_len_of(self.config.preset, self.config.seq_len)

    def build_model(self):
        """The model (torch is loaded here: reading a run's state and ledger does not need it)."""
        from ..model.albert import build_model
        return build_model(self.config.preset, self.config.seed, self.config.seq_len)

    @cached_property
    def flat(self):
        from ..model.albert import FlatLayout
        return FlatLayout(self.build_model())

    def _fmt(self, codec_name: str, whole: bool = False) -> VectorFormat:
        c = self.config
        return VectorFormat(codec_name, self.flat.n, c.chunk_size, c.block_size, whole)

    @cached_property
    def grad_format(self) -> VectorFormat:
        """A peer's shard: written whole, one object per array."""
        return self._fmt(self.config.codec, whole=True)

    @cached_property
    def dense_format(self) -> VectorFormat:
        """Parameters, optimizer state and reduced gradients: exact fp32."""
        return self._fmt("none")

    @cached_property
    def delta_format(self) -> VectorFormat:
        return self._fmt(self.config.param_codec)

    @property
    def n_parts(self) -> int:
        return -(-self.dense_format.n_chunks // self.config.chunks_per_part)

    def part_chunks(self, part: int) -> range:
        k = self.config.chunks_per_part
        return range(part * k, min((part + 1) * k, self.dense_format.n_chunks))

    def part_bounds(self, part: int) -> tuple[int, int]:
        return self.dense_format.bounds("values", self.part_chunks(part))

    # committed states
    def latest_hint(self) -> int:
        """The state LATEST points to (-1 without one). Buckets written before LATEST named its
        field ``state`` stored it under ``round``: both are read."""
        hint = self.bucket.read_json(self.keys.latest)
        if hint is None:
            return -1
        value = hint.get("state", hint.get("round"))
        if not isinstance(value, int) or value < 0:
            raise RunError(f"run {self.name!r}: LATEST.json holds no state number ({hint!r})")
        return value

    def latest(self) -> int:
        """Newest committed state. LATEST is a hint; COMMIT markers are the truth."""
        s = self.latest_hint()
        if s < 0:
            raise RunError(f"run {self.name!r} has no committed state yet")
        while self.bucket.exists(self.keys.commit(s + 1)):
            s += 1
        return s

    def commit_of(self, s: int) -> dict:
        c = self.bucket.read_json(self.keys.commit(s))
        if c is None:
            raise RunError(f"state {s} of run {self.name!r} is not committed")
        return c

    def load_params(self, s: int, commit: dict | None = None) -> np.ndarray:
        """The full snapshot of state s, checked against its COMMIT."""
        commit = commit or self.commit_of(s)
        return codec.read_vector(self.bucket, self.keys.params(s), self.dense_format,
                                 checksums={"values": commit["checksums"]["params"]})

    def apply_delta(self, s: int, params: np.ndarray, commit: dict | None = None) -> np.ndarray:
        """State s from state s-1 and s's compressed delta; bit-identical to the snapshot."""
        commit = commit or self.commit_of(s)
        fmt = self.delta_format
        d = codec.read_vector(self.bucket, self.keys.delta(s), fmt, raw=True,
                              checksums=commit["checksums"]["delta"])
        new = codec.delta_apply(params, d, fmt.codec, fmt.block)
        sums = codec.chunk_checksums(self.dense_format, {"values": new}, range(self.dense_format.n_chunks))
        if sums["values"] != commit["checksums"]["params"]:
            raise codec.CorruptShard(f"state {s}: delta does not reproduce the committed parameters")
        return new


def init_run(bucket: Bucket, config: RunConfig) -> Run:
    """Write run.json and commit state 0. Re-running with the same config is a no-op."""
    keys = RunLayout(config.run)
    check_data(bucket, config.data, config.preset, seq_len_of(config.preset, config.seq_len))
    existing = bucket.read_json(keys.config)
    if existing is not None:
        if RunConfig.model_validate(existing) != config:
            raise RunError(f"run {config.run!r} already exists in {bucket.url} with another config")
        run = Run(bucket, config.run)
        if bucket.exists(keys.commit(0)):
            return run
    else:
        bucket.create_json(keys.config, config.model_dump(mode="json"))
        run = Run(bucket, config.run)
    p0 = run.flat.get()
    if config.unigram_bias and config.data != SYNTHETIC:
        bias = run.flat.tensor("predictions.bias")
        p0[bias.offset:bias.offset + bias.size] = unigram_log_probs(bucket, config.data, bias.size)
    sums = codec.write_vector(bucket, keys.params(0), run.dense_format, {"values": p0})
    for name in ("exp_avg", "exp_avg_sq", "residual"):
        codec.create_vector(bucket, keys.optim(0, name), run.dense_format)  # zeros, no chunks
    bucket.create_json(keys.commit(0), {
        "state": 0, "round": None, "step": 0, "samples": 0, "contributors": [], "loss": None,
        "checksums": {"params": sums["values"]}, "committed_at": time.time(),
        "n_params": run.flat.n})
    bucket.write_json(keys.latest, {"state": 0})
    log.info("initialised run %s in %s: %d parameters", config.run, bucket.url, run.flat.n)
    return run
