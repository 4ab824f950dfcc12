"""Run configuration: written once to ``run.json`` by ``dedloc init``; every process reads it.

The fields' descriptions are also the help of ``dedloc init``'s options; ``json_schema_extra={"flag": ...}``
names an option spelled otherwise than its field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..model.presets import PRESETS, family
from ..storage.layout import LAYOUT_VERSION
from ..trust.identity import check_public

Codec = Literal["none", "fp16", "int8", "int4", "sparse"]


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["adamw", "lamb", "sgd"] = Field(
        "adamw", description="lamb: a trust ratio per tensor, for large batches (the sahajBERT recipe); "
        "sgd: with momentum, optionally Nesterov's", json_schema_extra={"flag": "--optimizer"})
    lr: float = Field(2e-3, gt=0, description="peak learning rate")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0, description="rounds of linear warmup to the peak learning rate")
    total_steps: int | None = Field(None, gt=0, description="linear decay to 0 over this many steps")
    clamp: float = Field(10.0, gt=0, description="LAMB: upper bound of the trust ratio")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD: momentum")
    nesterov: bool = Field(False, description="SGD: Nesterov's momentum")

    @property
    def slots(self) -> tuple[str, ...]:
        """The optimizer state each state keeps beside its parameters, a vector per name."""
        return ("momentum_buffer",) if self.name == "sgd" else ("exp_avg", "exp_avg_sq")


class Outer(BaseModel):
    """algorithm diloco: the step the aggregators take on the mean pseudo-gradient (DiLoCo's:
    Nesterov SGD, lr 0.7, momentum 0.9)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(0.7, gt=0, description="diloco: the outer step's learning rate",
                      json_schema_extra={"flag": "--outer-lr"})
    momentum: float = Field(0.9, ge=0, lt=1, description="diloco: the outer step's Nesterov momentum",
                            json_schema_extra={"flag": "--outer-momentum"})

    def optimizer(self) -> OptimizerConfig:
        return OptimizerConfig(name="sgd", lr=self.lr, momentum=self.momentum, nesterov=self.momentum > 0,
                               weight_decay=0.0)


class CloseRule(BaseModel):
    """When the scheduler closes a round."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(None, gt=0, description="close anyway after this many seconds ...",
                                    json_schema_extra={"flag": "--close-timeout"})
    min_fraction: float = Field(0.5, gt=0, le=1, description="... if this share of the target is in")
    late_shards: Literal["reject", "fold"] = Field(
        "reject", description="a shard that misses its round: dropped, or counted in the next one"
    )
    grace: float = Field(0.25, ge=0, description="once the target is reached, CLOSE waits up to this share of the "
                         "time the round took to fill for the live volunteers that have samples of it and sent no "
                         "part yet (sending at the same moment, they would miss the CLOSE and lose their samples); "
                         "a volunteer waited for in vain is not waited for again until it sends a part")
    max_parts: int = Field(8, gt=0, description="shards one volunteer may count in a round (an honest one "
                           "sends a second only when a peer vanished); later parts are rejected")
    max_share: float = Field(0.1, gt=0, le=1, description="one volunteer's samples count for at most "
                             "twice its fair share of the target (2/V of it, V the active volunteers), and never "
                             "less than this share, in the close rule and the mean's weights")
    min_agreement: float | None = Field(0.0, ge=-1, lt=1, description="local-steps mode: "
                                        "reject the shards of a volunteer whose sketched direction has a cosine "
                                        "below this with the median volunteer's (3 or more); None: off")
    probe_samples: int | None = Field(16, gt=0, description="local-steps mode: of each shard's claimed samples, "
                                      "how many (drawn in secret) the scheduler takes the loss gradient of at state "
                                      "r, for the loss screen, before CLOSE; None: off")
    min_descent: float = Field(2.0, description="local-steps mode: reject a shard whose cosine with the descent "
                               "direction of those samples' loss is below this many times a random direction's "
                               "spread (1/sqrt of its entries): noise scores about N(0, 1), honest shards 3 to "
                               "hundreds, reversed ones as far below 0")
    aggregate_s: float = Field(120.0, gt=0, description="volunteer aggregators (a scheduler run with them): "
                               "seconds after CLOSE in which two aggregators' agreeing answers settle a part; "
                               "then the organizer computes the parts left")
    audit: float = Field(0.125, gt=0, le=1, description="volunteer aggregators: the share of the chunks of "
                         "each part two aggregators agree on that the organizer recomputes before it counts "
                         "(one at least; all of them for an aggregator with few parts audited yet, and for 10 "
                         "rounds after a lie was caught): a lie over c of a part's n chunks survives an audit "
                         "of a with probability C(n-c, a)/C(n, a)")


class Cadence(BaseModel):
    """How often volunteers read the round view and heartbeat: fast near the target, slow far from
    it. Each interval is a share of the ETA (seconds until the round can fill), bounded: halving
    the ETA each time, a round costs about log2(round / poll_min_s) reads wherever it starts, and
    the last second of a round is still watched closely. A heartbeat is a projection
    (``protocol/heartbeat.py``): written when the peer's count strays from it, and as a keep-alive
    a share of the round's length after the last; between reads and heartbeats pending samples
    are projected at each peer's speed, so seldom heartbeats do not make the count lag behind the
    work."""

    model_config = ConfigDict(extra="forbid")

    poll_min_s: float = Field(0.5, gt=0, description="fastest round-view read (near the target)",
                              json_schema_extra={"flag": "--poll-min"})
    poll_max_s: float = Field(20.0, gt=0, description="slowest round-view read (far from it, or no view)",
                              json_schema_extra={"flag": "--poll-max"})
    heartbeat_min_s: float = Field(5.0, gt=0, description="shortest keep-alive between heartbeats (short rounds)")
    heartbeat_max_s: float = Field(60.0, gt=0, description="longest keep-alive between heartbeats (long rounds); "
                                   "a silent peer counts as gone that long plus two thirds of peer_timeout_s "
                                   "after its last", json_schema_extra={"flag": "--heartbeat-max"})
    poll_share: float = Field(0.5, gt=0, le=1, description="a poll every this share of the ETA")
    scheduler_poll_s: float = Field(20.0, gt=0, description="the scheduler's slowest poll, far from the target "
                                    "(nearer it, a share of the ETA down to poll_min_s); a poll where nothing "
                                    "changed is one LIST and one HEAD")
    heartbeat_share: float = Field(0.6, gt=0, le=1, description="a keep-alive heartbeat every this share of a "
                                   "round (over half: one a round, rounds a little longer than the last included; "
                                   "between them, one only when the peer's count strays from its projection)")

    @model_validator(mode="after")
    def _check(self) -> "Cadence":
        if self.poll_min_s > self.poll_max_s or self.heartbeat_min_s > self.heartbeat_max_s:
            raise ValueError("cadence: a minimum above its maximum")
        return self

    def poll_s(self, eta_s: float | None) -> float:
        """Seconds to the next round-view read."""
        return _bounded(eta_s, self.poll_share, self.poll_min_s, self.poll_max_s)

    def scheduler_s(self, eta_s: float | None) -> float:
        """Seconds to the scheduler's next poll: every ``scheduler_poll_s``, faster near the target."""
        return _bounded(eta_s, self.poll_share, min(self.poll_min_s, self.scheduler_poll_s), self.scheduler_poll_s)

    def heartbeat_s(self, round_s: float | None) -> float:
        """Seconds from one heartbeat to the keep-alive after it, for rounds of ``round_s``
        seconds (None: not known yet, the shortest): a heartbeat says how long it stands
        (``heartbeat.lifetime``), so long rounds need few."""
        if round_s is None:
            return self.heartbeat_min_s
        return _bounded(round_s, self.heartbeat_share, self.heartbeat_min_s, self.heartbeat_max_s)


def _bounded(eta_s: float | None, share: float, lo: float, hi: float) -> float:
    """``share`` of the ETA within [lo, hi]; unknown ETA (nobody computing, no view): hi."""
    return hi if eta_s is None else min(hi, max(lo, share * eta_s))


SPARSE_NORM_SCREEN = 3.0  # the norm screen's default with sparse shards (docs/verification.md)


# a target batch no collaboration could fill (sahajBERT's was 4096): refused at `dedloc init`
MAX_TARGET = 1 << 24

class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layout_version: int = LAYOUT_VERSION
    run: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    preset: str = Field("tiny", description=f"{' | '.join(PRESETS)}: the model, and the recipe that fills "
                        "the settings not given")
    seq_len: int | None = Field(None, gt=8, description="tokens per sequence; default: the preset's")
    data: str = Field("synthetic", description="a data set in the bucket (the tokenize flow writes one)")
    data_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the data set's "
                                  "DATA.json, pinned by `dedloc init` (peers refuse a card that does not match)")
    seed: int = Field(0, description="model init, data order and masking")
    target_batch_size: int = Field(256, gt=0, le=MAX_TARGET, description="samples per optimizer step, summed over "
                                   "all peers",
                                   json_schema_extra={"flag": "--target-batch"})
    micro_batch: int = Field(8, gt=0, description="a worker's micro-batch (volunteers may choose theirs)")
    codec: Codec = Field("int8", description="gradient shards peers upload (none: fp32, exact)")
    download_codec: Codec | None = Field(
        None, description="parameter deltas peers download; default: int4 for int8 shards, else codec")
    block_size: int = Field(4096, gt=0, description="int8: elements per absmax scale")
    chunk_size: int = Field(1 << 20, gt=0, description="elements per zarr chunk of the flat vector")
    chunks_per_part: int = Field(1, gt=0, description="chunks one aggregator task reduces")
    max_grad_norm: float = Field(1e4, gt=0, description="a shard above this L2 norm is rejected")
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = Field(
        "mean", description="mean: exact (N peers = one process); the others bound what a minority "
        "of byzantine peers can do, at the cost of exactness")
    trim_fraction: float = Field(0.2, ge=0, lt=0.5,
                                 description="trimmed_mean: shards dropped at each end, per coordinate")
    clip_iters: int = Field(3, gt=0, description="centered_clip: fixed-point iterations")
    norm_screen: float | None = Field(
        10.0, gt=1, description="reject a shard whose norm is above this multiple of the median of "
        "the round's shards (with 3 or more; 3 with sparse shards); None: off")
    organizer_key: str | None = Field(
        None, description="Ed25519 public key (base64): when set, only shards signed by volunteers "
        "in the roster this key signed are admitted")
    delayed_updates: bool = Field(True, description="keep computing while a round is reduced (one step stale)")
    unigram_bias: bool = Field(False, description="start the masked-LM output bias at the data's log "
                               "unigram frequencies, so training need not pass through the unigram phase")
    keep_states: int = Field(3, ge=2, description="recent states kept whole; older ones are pruned")
    checkpoint_every: int = Field(100, gt=0, description="states whose params and optimizer stay")
    peer_timeout_s: float = Field(30.0, gt=0, description="seconds before a silent peer counts as gone",
                                  json_schema_extra={"flag": "--peer-timeout"})
    algorithm: Literal["dedloc", "diloco"] = Field(
        "dedloc", description="dedloc: one optimizer step per filled batch; diloco: local steps on each "
        "volunteer, then an outer step on their mean (docs/diloco.md)")
    inner_batch: int = Field(64, gt=0, description="diloco: samples per optimizer step on a volunteer")
    inner_state: Literal["shard", "kept"] = Field(
        "shard", description="diloco: a volunteer's inner optimizer starts fresh with each shard, so the "
        "validator can replay the shard (shard); or is kept across shards as DiLoCo's is, and shards are "
        "only screened (kept)")
    cadence: Cadence = Cadence()
    optimizer: OptimizerConfig = OptimizerConfig()
    outer: Outer = Outer()
    close: CloseRule = CloseRule()

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.chunk_size % self.block_size:
            raise ValueError("chunk_size must be a multiple of block_size")
        if self.organizer_key is not None:
            check_public(self.organizer_key)
        if self.codec == "sparse" and "norm_screen" not in self.model_fields_set:
            # a sparse shard's scale is its volunteer's error feedback, which its replay cannot
            # check: honest shards stayed within 1.29x of the round's median volunteer, x8 ones at 7.9
            self.norm_screen = SPARSE_NORM_SCREEN
        if self.codec == "sparse" and self.algorithm != "diloco":
            raise ValueError("the sparse codec is for diloco's pseudo-gradients (--algorithm diloco); the "
                             "default algorithm's validator has no tolerance for it")
        if "sparse" in (self.codec, self.download_codec) and (self.block_size % 256 or self.block_size > 1 << 16):
            # 1/64 kept, 4 codes a byte; a position in its block is 16 bits
            raise ValueError("the sparse codec needs a block size that is a multiple of 256, at most 65536")
        if self.unigram_bias and family(self.preset) == "causal":
            raise ValueError("unigram_bias starts an ALBERT's masked-LM output bias; a causal decoder has none")
        if self.algorithm == "diloco" and self.optimizer.name == "lamb":
            raise ValueError("diloco's inner optimizer (on the volunteers) is adamw or sgd")
        if self.layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"run uses bucket layout v{self.layout_version}; this dedloc reads v{LAYOUT_VERSION}"
            )
        return self

    @property
    def aggregator_optimizer(self) -> OptimizerConfig:
        """The step the aggregators take on the round's mean: the optimizer itself, or in
        diloco the outer step (the optimizer then runs on the volunteers)."""
        return self.outer.optimizer() if self.algorithm == "diloco" else self.optimizer

    @property
    def param_codec(self) -> Codec:
        """The aggregator keeps what the delta's codec drops and adds it to the next delta, so
        int4 deltas cost nothing in loss measurably (benchmark 2) at half of int8's bytes."""
        if self.download_codec:
            return self.download_codec
        return "int4" if self.codec == "int8" else self.codec


# Run defaults that belong to a preset: the DeDLOC recipe for sahajBERT (LAMB, target batch 4096).
# tiny and small on text: from a zero output bias at lr 2e-3 every token state collapses to one
# within 10 steps (the masked LM's unigram phase); the unigram bias skips that phase. Then, for
# tiny: in one process lr 1e-3 and 2e-3 (after warmup) learn context alike, faster than 5e-4, and
# 4e-3 falls back to the start within 80 steps; in the collaboration (stale samples, int8) 2e-3
# once spiked back halfway there, so 1e-3 (docs/first-run.md).
RECIPES: dict[str, dict] = {
    "tiny": {"unigram_bias": True, "optimizer": {"lr": 1e-3, "warmup_steps": 20}},
    "small": {"target_batch_size": 512, "unigram_bias": True, "optimizer": {"lr": 5e-4}},  # not re-measured
    "sahajbert": {"target_batch_size": 4096, "unigram_bias": True,
                  "optimizer": {"name": "lamb", "lr": 0.00176, "warmup_steps": 5000, "weight_decay": 0.01,
                                "eps": 1e-6, "clamp": 10000.0}},
    # causal decoders: tiny as tiny ALBERT; the large ones with the learning rates their namesakes
    # trained at (GPT-2 small 6e-4, TinyLlama 4e-4, Llama-2-7B 3e-4; not measured here), and the
    # 1B and 7B in the local-steps mode with sparse updates, averaged (outer lr 1, no momentum:
    # a sparse download cannot carry a dense momentum; benchmark 9, docs/diloco.md)
    "causal-tiny": {"optimizer": {"lr": 1e-3, "warmup_steps": 20}},
    "causal-125m": {"optimizer": {"lr": 6e-4, "warmup_steps": 20}},
    "causal-1b": {"algorithm": "diloco", "codec": "sparse", "outer": {"lr": 1.0, "momentum": 0.0},
                  "optimizer": {"lr": 4e-4, "warmup_steps": 5}},
    "causal-7b": {"algorithm": "diloco", "codec": "sparse", "outer": {"lr": 1.0, "momentum": 0.0},
                  "optimizer": {"lr": 3e-4, "warmup_steps": 5}},
}
RECIPES["micro"] = RECIPES["tiny"]  # the tests' model trains as tiny does (not re-measured)


def recipe_config(run: str, preset: str = "tiny", optimizer: dict | None = None, **fields) -> RunConfig:
    """A RunConfig from the preset's recipe, with explicitly given values (not None) on top; a
    nested setting (the optimizer, the outer step) is merged field by field."""
    merged = dict(RECIPES.get(preset, {}))
    for k, v in {**fields, "optimizer": optimizer or {}}.items():
        if isinstance(v, dict):
            merged[k] = {**merged.get(k, {}), **{kk: vv for kk, vv in v.items() if vv is not None}}
        elif v is not None:
            merged[k] = v
    return RunConfig(run=run, preset=preset, **merged)
