"""A collaboration's bill in dollars: requests by price class and bytes, at S3's and R2's list prices.

Two ways in, one way out. ``estimate`` models a planned run from the protocol itself: the round's
length from the target and the peers' speed, the volunteers' round-view reads and heartbeats from
the run's ``Cadence`` as the round's ETA falls, and every shard upload, state download and
scheduler step from the zarr layout of the vectors it moves (``Layout``: chunks and metadata
objects, counted as botocore sends them, which ``tests/test_cost.py`` checks against a real round
on an S3 server). ``measured`` prices what ``IOStats`` counted instead. Both end in ``bill``, with
one price table (``PRICES``) that a JSON file can replace (``load_prices``).

Egress is what clients read from the bucket (a volunteer's downloads, the scheduler's reads when
it runs outside the provider's region); uploads are ingress, free at both providers.

Torch-free: ``dedloc cost`` starts without loading the model.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, ValidationError, computed_field

from ..model.presets import PRESETS, family
from ..protocol.config import RunConfig
from ..protocol.shard import DataRef, Manifest
from ..protocol.view import View
from ..storage.vector import VectorFormat
from ..storage.layout import LAYOUT_VERSION

HOUR, DAY, MONTH_DAYS = 3600.0, 86400.0, 30.0


# prices

class Provider(BaseModel):
    """One provider's list prices, keyed by ``IOStats``' request kinds (get, put, head, list,
    delete, and ``other`` for any kind not named)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    per_million: dict[str, NonNegativeFloat] = Field(description="dollars per million requests, by kind")
    egress_per_gb: NonNegativeFloat = Field(description="bytes clients read from the bucket over the internet")
    ingress_per_gb: NonNegativeFloat = 0.0
    storage_per_gb_month: NonNegativeFloat
    notes: str = ""

    def request_price(self, kind: str) -> float:
        """Dollars per million requests of ``kind``."""
        price = self.per_million.get(kind, self.per_million.get("other"))
        if price is None:
            raise ValueError(f"price table: {self.name} has no price for {kind!r} requests (nor 'other')")
        return price


class PriceTable(BaseModel):
    model_config = ConfigDict(extra="forbid")

    date: datetime.date = Field(description="when these prices were read")
    source: str
    gigabyte: int = Field(2**30, gt=0, description="bytes in a billed GB (AWS bills binary gigabytes)")
    providers: dict[str, Provider] = Field(min_length=1)


PRICES = PriceTable(
    date=datetime.date(2026, 12, 1),
    source="list prices on the providers' pricing pages: https://aws.amazon.com/s3/pricing/ and "
           "https://developers.cloudflare.com/r2/pricing/; free tiers not counted",
    providers={
        "s3": Provider(
            name="AWS S3 Standard (us-east-1)",
            per_million={"put": 5.0, "post": 5.0, "list": 5.0, "get": 0.4, "head": 0.4, "delete": 0.0,
                         "other": 0.4},
            egress_per_gb=0.09, storage_per_gb_month=0.023,
            notes="PUT, COPY, POST, LIST $0.005 per 1,000; GET, HEAD and all other $0.0004 per 1,000; DELETE "
                  "free; data transfer out to the internet $0.09/GB (first 10 TB a month), in free; storage "
                  "$0.023/GB-month (first 50 TB). Reads from EC2 in the same region pay no transfer."),
        "r2": Provider(
            name="Cloudflare R2 Standard",
            per_million={"put": 4.5, "post": 4.5, "list": 4.5, "get": 0.36, "head": 0.36, "delete": 0.0,
                         "other": 4.5},
            egress_per_gb=0.0, storage_per_gb_month=0.015,
            notes="Class A (PutObject, ListObjects, CopyObject, multipart) $4.50 per million; Class B "
                  "(GetObject, HeadObject) $0.36 per million; DeleteObject free; egress free; storage "
                  "$0.015/GB-month. The monthly free tier (10 GB-month, 1M Class A, 10M Class B) is not counted."),
    },
)


def load_prices(path: str | Path) -> PriceTable:
    """A price table from a JSON file shaped like ``PRICES`` (``PRICES.model_dump_json()``); it
    replaces the built-in one. A bad file raises ValueError saying what is wrong."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"prices {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"prices {path}: not a JSON file ({exc})") from None
    try:
        return PriceTable.model_validate(raw)
    except ValidationError as exc:
        wrong = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'table'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"prices {path}: {wrong}") from None


class Dollars(BaseModel):
    requests: dict[str, float] = Field(description="by request kind")
    egress: float = 0.0
    ingress: float = 0.0
    storage: float = 0.0

    @computed_field
    @property
    def total(self) -> float:
        return sum(self.requests.values()) + self.egress + self.ingress + self.storage


def bill(requests: Mapping[str, float], bytes_out: float, bytes_in: float, provider: str | Provider,
         prices: PriceTable = PRICES, gb_months: float = 0.0) -> Dollars:
    """Dollars at one provider for ``requests`` (by kind), ``bytes_out`` read from the bucket (its
    egress), ``bytes_in`` written to it, and ``gb_months`` of storage."""
    if isinstance(provider, str):
        if provider not in prices.providers:
            raise ValueError(f"price table has no provider {provider!r}; it has {', '.join(prices.providers)}")
        provider = prices.providers[provider]
    gb = prices.gigabyte
    return Dollars(requests={k: n * provider.request_price(k) / 1e6 for k, n in requests.items()},
                   egress=bytes_out / gb * provider.egress_per_gb, ingress=bytes_in / gb * provider.ingress_per_gb,
                   storage=gb_months * provider.storage_per_gb_month)


# what the protocol moves

@dataclass(frozen=True)
class Requests:
    """Requests by the price class ``IOStats`` counts them in."""

    get: float = 0.0
    put: float = 0.0
    head: float = 0.0
    list: float = 0.0
    delete: float = 0.0

    def __add__(self, other: "Requests") -> "Requests":
        return Requests(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, k: float) -> "Requests":
        return Requests(*(a * k for a in astuple(self)))

    __rmul__ = __mul__

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Bytes per parameter of one shard (up) and one parameter delta (down), from real training
# (docs/benchmarks.md, IOStats, 2026-11-30): benchmark 1 (tiny at sequence 128, 64-90 samples a
# shard) for the default int8 shards and int4 deltas, benchmark 2 (sequence 64) for the others.
# Not derived from the codec: a random gradient compresses worse than a real one (int8: 0.96).
SHARD_BYTES_PER_PARAM = {"none": 2.61, "fp16": 1.07, "int8": 0.66, "int4": 0.226}
DELTA_BYTES_PER_PARAM = {"none": 2.98, "fp16": 1.42, "int8": 0.831, "int4": 0.47}
DENSE_BYTES_PER_PARAM = 4.0  # fp32 parameters, optimizer state, reduced gradient: Blosc barely shrinks them
HEARTBEAT_BYTES = 300  # protocol/view.py: an honest heartbeat is ~300 bytes
CHECKSUM_JSON_BYTES = 38  # one chunk's 32-hex checksum in indented JSON (COMMIT, CLOSE)
SHARD_ENTRY_BYTES = 250  # a shard's entry in a COMMIT (key, peer, samples, loss, manifest hash)
OPTIM_STATE = ("exp_avg", "exp_avg_sq")  # protocol/optim.py's STATE (torch there; the test compares)
PRUNE_WINDOW = 3  # scheduler.prune's window: the states a process looks back at its first prune
S3_PAGE = 1000  # keys per LIST page and per DeleteObjects request
# Measured: samples/s of one volunteer, where a benchmark has it. tiny: benchmark 1's limit, one
# single-thread process per core (35.7 samples/s on 2 cores). sahajbert on a GPU is not measured yet.
SAMPLES_PER_S = {"tiny": 17.8}
# Seconds from CLOSE to COMMIT: benchmark 5's fit (validate, reduce, apply, commit; one scheduler
# with 2 threads on a warm file:// bucket): 0.25 + 1.1e-8 * peers * parameters. S3 adds transfer time.
REDUCE_S = (0.25, 1.1e-8)


def n_params(preset: str, seq_len: int | None = None) -> int:
    """Parameters of a preset's ALBERT (masked-LM and sentence-order heads, one shared layer), as
    ``model/albert.py`` builds it: the MLM decoder's weight is the word embedding and its bias
    ``predictions.bias``, so both count once. Positions: the preset's, or ``seq_len`` if longer.
    A causal decoder's: ``causal_params``."""
    c = PRESETS[preset]
    if family(preset) == "causal":
        return causal_params(preset)
    v, e, h, i = c["vocab_size"], c["embedding_size"], c["hidden_size"], c["intermediate_size"]
    positions = max(seq_len or 0, c["max_position_embeddings"])
    embeddings = (v + positions + 2) * e + 2 * e  # words, positions, 2 token types, LayerNorm
    mapping = e * h + h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h  # attention, its norm, FFN, norm
    pooler = h * h + h
    mlm_head = v + (h * e + e) + 2 * e
    sop_head = 2 * h + 2
    return embeddings + mapping + layer + pooler + mlm_head + sop_head


def causal_params(preset: str) -> int:
    """A Llama preset's parameters, as ``model/causal.py`` builds it (rotary positions: none
    stored; no biases; the output projection is the embedding when tied)."""
    c = PRESETS[preset]
    v, h, i, layers = c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q and o, k and v, the gated MLP, 2 norms
    return v * h * (1 if c["tie_word_embeddings"] else 2) + layers * layer + h


def _chunks(fmt: VectorFormat) -> list[int]:
    """Chunks of each of a vector's arrays."""
    return [-(-length // clen) for _, length, clen in fmt.arrays().values()]


def _objects(fmt: VectorFormat) -> int:
    """Objects a whole vector is stored as: each array's chunks (one object for a vector
    written whole) and its ``zarr.json``."""
    return sum((1 if fmt.whole else c) + 1 for c in _chunks(fmt))


def _reads(fmt: VectorFormat, chunks: int | None = None) -> int:
    """GETs of a checksummed read (no metadata) of ``chunks`` chunks of each array (default
    all): a chunk each, or for a vector written whole one object, and for a range of it the
    shard's index and then the range's chunks."""
    arrays = len(fmt.arrays())
    if chunks is None or chunks >= fmt.n_chunks:
        return arrays if fmt.whole else sum(_chunks(fmt))
    return arrays * (chunks + int(fmt.whole))


class Layout:
    """The vectors a run moves and how the bucket stores them, from its config alone (no model)."""

    def __init__(self, config: RunConfig, n: int | None = None):
        self.config = config
        self.n = n_params(config.preset, config.seq_len) if n is None else n

        def fmt(codec_name: str, whole: bool = False) -> VectorFormat:
            return VectorFormat(codec_name, self.n, config.chunk_size, config.block_size, whole)

        self.grad = fmt(config.codec, whole=True)
        self.delta, self.dense = fmt(config.param_codec), fmt("none")
        chunks, k = self.dense.n_chunks, config.chunks_per_part
        self.parts = [min(k, chunks - lo) for lo in range(0, chunks, k)]
        self.lossy_delta = config.param_codec != "none"  # the organizer's residual is written
        self.lamb = config.optimizer.name == "lamb"

    @property
    def chunks(self) -> int:
        return self.dense.n_chunks

    def manifest_bytes(self) -> int:
        """One shard's manifest as ``shard.upload`` writes it (a chunk checksum of each array)."""
        g = self.grad
        m = Manifest(layout_version=LAYOUT_VERSION, run="r" * 16, round=10**5, peer="p" * 16,
                     part="1" * 13 + "-abcdef", codec=g.codec, n=g.n, chunk_size=g.chunk_size, block=g.block,
                     samples=64, loss=1.0, data=DataRef(stream="p" * 16, ranges=[(10**6, 64)]),
                     checksums={name: ["0" * 32] * c for name, c in zip(g.arrays(), _chunks(g))},
                     state_hash="0" * 64, created_at=1.8e9)
        return len(json.dumps(m.model_dump(mode="json"), indent=1, sort_keys=True))

    def commit_bytes(self, shards: int) -> int:
        """A COMMIT, about: the checksums of the parameters and the delta, an entry per shard."""
        return 500 + CHECKSUM_JSON_BYTES * (self.chunks + sum(_chunks(self.delta))) + SHARD_ENTRY_BYTES * shards

    # requests, as botocore sends them to S3 (R2 speaks the same API through the same client)
    def shard_upload(self) -> Requests:
        """``shard.upload``: each array's metadata and its one object of chunks, then the
        manifest; nothing read."""
        return Requests(put=_objects(self.grad) + 1)

    def state_download(self) -> Requests:
        """A synced peer moving one state on: the COMMIT, then each chunk of the delta (checksummed
        reads skip zarr's metadata)."""
        return Requests(get=1 + sum(_chunks(self.delta)))

    def scheduler_poll(self, heartbeats: int, manifests: int, first: bool = False) -> Requests:
        """One poll of the scheduler that does not close the round (``Scheduler.try_close``): its
        CLOSE, the round's heartbeats and manifests listed and the given numbers read (those
        written since the last poll), STOP, and the view written. The round's first poll also
        reads what the round is judged against (``Scheduler._opening``): the COMMIT that opened
        it, the streams record, and the validator's flags (a listing). A listing is one LIST a
        1000 keys, empty or not."""
        cfg = self.config
        r = Requests(get=1 + heartbeats + manifests + 2 * int(first), put=1, head=1, list=2 + int(first))
        r += Requests(get=int(cfg.organizer_key is not None))  # the roster
        if cfg.close.late_shards == "fold":  # the previous round's CLOSE and its manifests' listing
            r += Requests(get=1 + int(cfg.organizer_key is not None), list=1)
        return r

    def closing(self, shards: int) -> Requests:
        """What closing adds to its poll: the round's shards listed (with their sizes), each new
        one validated (every chunk read and checksummed), the validator's flags listed again,
        CLOSE created and read back."""
        listing = max(1, math.ceil(shards * _objects(self.grad) / S3_PAGE))
        return Requests(list=listing + 1, get=shards * _reads(self.grad)) + Requests(put=1, get=1)

    def finish(self, shards: int) -> Requests:
        """``Scheduler.finish`` of a closed round: prepare, reduce and apply every part, commit
        (``prune`` apart: ``prune_steady``)."""
        dense_arrays = 1 + 1 + len(OPTIM_STATE) + 1  # reduced gradient, params, state, residual
        delta_arrays = len(self.delta.arrays())
        total = Requests(get=dense_arrays + delta_arrays, put=dense_arrays + delta_arrays)  # prepare
        whole = len(self.parts) == 1  # a part that writes every chunk also makes (finds) the arrays
        for c in self.parts:
            reduce = Requests(head=1, get=1 + shards * _reads(self.grad, c) + 1 + whole, put=c + 1)
            if self.lamb:  # partial norms need the range's params and state
                reduce += Requests(get=(1 + len(OPTIM_STATE)) * (1 + c))
            written = 1 + delta_arrays + len(OPTIM_STATE) + int(self.lossy_delta)
            apply = Requests(head=1, get=(1 + c) + (2 + len(OPTIM_STATE)) * (1 + c) + written * (1 + whole),
                             put=written * c + 1)
            if self.lamb:
                apply += Requests(get=len(self.parts))
            total += reduce + apply
        commit = Requests(get=5 + len(self.parts), put=3)
        return total + commit

    def between_rounds(self) -> Requests:
        """The round loop's own poll after a commit: LATEST, the next COMMIT's absence, CLOSE, STOP."""
        return Requests(get=2, head=2)

    def prune_state(self, shards: int, peers: int, checkpoint: bool = False) -> Requests:
        """``scheduler.prune`` deleting one state that leaves the kept window, and its round's
        scratch: a LIST page and a DeleteObjects per 1000 keys of each prefix (streams.json, a
        single object, too). A checkpoint keeps its params and optimizer state."""
        dense = self.dense
        prefixes = [len(self.parts), _objects(self.delta), shards * _objects(self.grad), shards, peers,
                    _objects(dense) + len(self.parts)]  # applied, delta, shards, manifests, heartbeats, reduced
        if not checkpoint:
            prefixes += [_objects(dense), (len(OPTIM_STATE) + 1) * (dense.n_chunks + 1)]  # params, optim
        r = Requests(list=1, delete=1)
        for objects in prefixes:
            pages = max(1, math.ceil(objects / S3_PAGE))
            r += Requests(list=pages, delete=pages)
        return r

    def prune_missing(self, checkpoint: bool = False) -> Requests:
        """``scheduler.prune`` deleting a state that is gone already (the ``PRUNE_WINDOW`` a
        process looks back once): one LIST a prefix."""
        return Requests(list=1) * (9 - 2 * checkpoint)

    def prune_steady(self, shards: int, peers: int) -> Requests:
        """``scheduler.prune`` after one commit in a long run, on average: one state leaves the
        kept window (a process deletes each state once)."""
        k = 1 / self.config.checkpoint_every
        return self.prune_state(shards, peers) * (1 - k) + self.prune_state(shards, peers, True) * k


# a planned run

class Rates(BaseModel):
    requests: dict[str, float] = Field(description="per hour, by kind")
    bytes_up: float = Field(description="per hour, written to the bucket (its ingress)")
    bytes_down: float = Field(description="per hour, read from the bucket (its egress)")


class ProviderCost(BaseModel):
    volunteer_day: Dollars
    scheduler_day: Dollars
    storage: float = Field(description="the bucket's storage over the whole run")
    run: float = Field(description="the whole run: every volunteer, the scheduler, storage")
    scheduler_share: float


class Estimate(BaseModel):
    preset: str
    n_params: int
    chunks: int
    peers: int
    days: float
    samples_per_s: float = Field(description="one volunteer's")
    target: int
    round_s: float = Field(description="seconds from one commit to the next")
    open_s: float = Field(description="of which the round is open and filling")
    settle_s: float = Field(description="of which the last shards upload and the round is reduced")
    rounds: float = Field(description="in the whole run")
    view_reads_per_round: float
    heartbeats_per_round: float
    scheduler_polls_per_round: float
    volunteer_hour: Rates
    scheduler_hour: Rates
    scheduler_egress: bool = Field(description="the scheduler's reads billed as egress (it runs outside the "
                                   "provider's region)")
    storage_gb: float = Field(description="stored on average over the run")
    storage_gb_months: float
    prices_date: datetime.date
    cost: dict[str, ProviderCost]


def _count(interval, span: float, steps: int = 2000) -> float:
    """Events over ``span`` seconds while the ETA falls from ``span`` to 0, one every
    ``interval(eta)`` seconds: the integral of 1 / interval, on a geometric grid of ETAs (the
    cadence's intervals are shares of the ETA, so every scale of it matters alike)."""
    if span <= 0:
        return 0.0
    lo = min(1e-3, span)
    total = lo / interval(lo / 2)
    edges = [lo * (span / lo) ** (k / steps) for k in range(steps + 1)]
    for a, b in zip(edges, edges[1:]):
        total += (b - a) / interval(math.sqrt(a * b))
    return total


def estimate(config: RunConfig, peers: int, days: float, samples_per_s: float | None = None, *,
             prices: PriceTable = PRICES, n: int | None = None, reduce_s: float | None = None,
             uplink_mbit_s: float = 20.0, scheduler_poll_s: float | None = None, scheduler_egress: bool = True,
             micro_batch: int | None = None, shard_bytes_per_param: float | None = None,
             delta_bytes_per_param: float | None = None) -> Estimate:
    """The traffic and bill of ``peers`` volunteers training ``config`` for ``days``, each at
    ``samples_per_s`` (default: the preset's measured speed), in the steady state.

    A round takes ``target / (peers * samples_per_s)`` seconds of computing. It is open while the
    ETA falls linearly to 0, then settles: the last shard uploads (``uplink_mbit_s``) and the
    scheduler reduces (``reduce_s``, default benchmark 5's fit). With delayed updates volunteers
    keep computing while it settles, so a round lasts its computing time (at least the settling);
    without, the two add. Volunteers read the view and heartbeat at the cadence's intervals for
    the ETA (0 once the round can fill; while it is reduced, what the last reduction took,
    less the time since; once the view is unchanged for ``peer_timeout_s`` a fallback check of
    LATEST and STOP every ``poll_max_s``), rounded up to whole micro-batches (``micro_batch``, default the run's: a
    computing worker looks between them), upload one shard and download one state per round. The scheduler polls at the
    cadence too (every ``scheduler_poll_s`` if given) until the round closes, reading each
    heartbeat once per write and each manifest once, then validates, reduces, applies, commits
    and prunes.
    """
    if peers < 1 or days <= 0:
        raise ValueError("a planned run needs at least 1 peer and more than 0 days")
    speed = SAMPLES_PER_S.get(config.preset) if samples_per_s is None else samples_per_s
    if speed is None:
        raise ValueError(f"no measured speed for preset {config.preset!r}: give the volunteers' samples/s")
    if speed <= 0 or uplink_mbit_s <= 0 or (scheduler_poll_s is not None and scheduler_poll_s <= 0):
        raise ValueError("samples/s, the uplink and the scheduler's poll interval must be positive")
    lay = Layout(config, n)
    cad, timeout = config.cadence, config.peer_timeout_s
    shard_b = lay.n * (SHARD_BYTES_PER_PARAM[config.codec] if shard_bytes_per_param is None else shard_bytes_per_param)
    delta_b = lay.n * (DELTA_BYTES_PER_PARAM[config.param_codec] if delta_bytes_per_param is None
                       else delta_bytes_per_param)
    fill_s = config.target_batch_size / (peers * speed)
    upload_s = shard_b * 8 / (uplink_mbit_s * 1e6)
    reduce_s = REDUCE_S[0] + REDUCE_S[1] * peers * lay.n if reduce_s is None else reduce_s
    settle_s = upload_s + reduce_s
    round_s = max(fill_s, settle_s) if config.delayed_updates else fill_s + settle_s
    open_s = round_s - settle_s

    step_s = (config.micro_batch if micro_batch is None else micro_batch) / speed

    def between_steps(interval: float) -> float:
        """A computing volunteer looks at its clock between micro-batches."""
        return math.ceil(interval / step_s - 1e-9) * step_s

    def poll(eta: float) -> float:
        return between_steps(cad.poll_s(eta))

    def beat(eta: float) -> float:
        return between_steps(cad.heartbeat_s(eta, timeout))

    def sched_poll(eta: float) -> float:
        return cad.poll_s(eta) if scheduler_poll_s is None else scheduler_poll_s

    # per round, the scheduler: polls until CLOSE (the first reads the opening COMMIT and every
    # live heartbeat, later ones the heartbeats written since), then the round's own work
    polls = max(1.0, _count(sched_poll, open_s) + upload_s / sched_poll(0.0))
    beats_open = _count(beat, open_s) + upload_s / beat(0.0)
    changed = peers * (1 + min(beats_open, polls))
    sched = (lay.scheduler_poll(0, 0) * polls
             + Requests(get=1 + changed + peers) + lay.closing(peers) + lay.finish(peers)
             + lay.prune_steady(peers, peers) + lay.between_rounds())
    view_b = _view_bytes(config)
    dense = DENSE_BYTES_PER_PARAM * lay.n
    state_reads = (1 + 2 + len(OPTIM_STATE)) + (1 + len(OPTIM_STATE) if lay.lamb else 0)
    sched_down = (lay.commit_bytes(peers) + changed * HEARTBEAT_BYTES + peers * lay.manifest_bytes()
                  + 2 * peers * shard_b + state_reads * dense)
    close_b = 200 + peers * lay.manifest_bytes()
    optim_writes = len(OPTIM_STATE) + int(lay.lossy_delta)
    sched_up = polls * view_b + close_b + (2 + optim_writes) * dense + delta_b + lay.commit_bytes(peers)

    # per round and volunteer; a volunteer heartbeats when its upload starts and when it lands,
    # and reads the view at once.
    # A view read is a conditional GET: it carries a body only when the scheduler wrote one since.
    reads_open = _count(poll, open_s) + upload_s / poll(0.0) + 1
    def while_reduced(interval: float) -> float:
        """Computing ahead with delayed updates; else waiting, looking every quarter interval."""
        return between_steps(interval) if config.delayed_updates else interval

    # reading a closed view, a volunteer polls at a share of what the last reduction took
    closed_reads = _count(lambda eta: while_reduced(cad.poll_s(eta)), reduce_s)
    fallbacks = max(0.0, reduce_s - timeout) / cad.poll_max_s  # the view unchanged: LATEST and STOP
    beats = beats_open + reduce_s / while_reduced(cad.heartbeat_s(0.0, timeout)) + 2  # upload sent, landed
    volunteer = (Requests(get=reads_open + closed_reads, put=beats)
                 + Requests(get=1, head=2) * fallbacks + lay.shard_upload() + lay.state_download())
    vol_up = shard_b + lay.manifest_bytes() + beats * HEARTBEAT_BYTES
    vol_down = delta_b + min(reads_open, polls) * view_b + lay.commit_bytes(peers)

    per_hour, per_day = HOUR / round_s, DAY / round_s
    vol_hour = Rates(requests=(volunteer * per_hour).as_dict(), bytes_up=vol_up * per_hour,
                     bytes_down=vol_down * per_hour)
    sched_hour = Rates(requests=(sched * per_hour).as_dict(), bytes_up=sched_up * per_hour,
                       bytes_down=sched_down * per_hour)

    # storage: the kept states and rounds, plus the checkpoints and the ledger, which grow
    rounds = days * DAY / round_s
    state_b = (1 + optim_writes) * dense + delta_b
    round_b = peers * (shard_b + lay.manifest_bytes() + HEARTBEAT_BYTES) + dense
    kept = config.keep_states * (state_b + round_b)
    grows = (rounds / config.checkpoint_every * (1 + optim_writes) * dense
             + rounds * (close_b + lay.commit_bytes(peers)))
    stored_gb = (kept + grows / 2) / prices.gigabyte
    gb_months = stored_gb * days / MONTH_DAYS

    cost = {}
    for name in prices.providers:
        vd = bill((volunteer * per_day).as_dict(), vol_down * per_day, vol_up * per_day, name, prices)
        sd = bill((sched * per_day).as_dict(), sched_down * per_day * scheduler_egress, sched_up * per_day,
                  name, prices)
        storage = bill({}, 0, 0, name, prices, gb_months=gb_months).storage
        run = peers * days * vd.total + days * sd.total + storage
        cost[name] = ProviderCost(volunteer_day=vd, scheduler_day=sd, storage=storage, run=run,
                                  scheduler_share=days * sd.total / run if run else 0.0)
    return Estimate(preset=config.preset, n_params=lay.n, chunks=lay.chunks, peers=peers, days=days,
                    samples_per_s=speed, target=config.target_batch_size, round_s=round_s, open_s=open_s,
                    settle_s=settle_s, rounds=rounds, view_reads_per_round=reads_open + closed_reads,
                    heartbeats_per_round=beats, scheduler_polls_per_round=polls, volunteer_hour=vol_hour,
                    scheduler_hour=sched_hour, scheduler_egress=scheduler_egress, storage_gb=stored_gb,
                    storage_gb_months=gb_months, prices_date=prices.date, cost=cost)


def _view_bytes(config: RunConfig) -> int:
    """A round view as the scheduler publishes it, late in a long run."""
    v = View(state=10**5, round=10**5, target=config.target_batch_size, validated_samples=config.target_batch_size,
             shards=999, pending_samples=config.target_batch_size, peers=999, samples_per_s=12345.678901,
             eta_s=123.456789, at=1.8e9 + 0.123456, written_at=1.8e9 + 0.234567)
    return len(v.model_dump_json())


# a measured run

class MeasuredCost(BaseModel):
    volunteer_hour: Dollars
    volunteer_day: Dollars


class Measured(BaseModel):
    volunteers: int
    seconds: float
    volunteer_hour: Rates
    cost: dict[str, MeasuredCost]


def measured(snapshot: Mapping, seconds: float, volunteers: int, prices: PriceTable = PRICES) -> Measured:
    """Dollars per volunteer-hour and -day from what ``IOStats`` counted: ``snapshot`` is an
    ``IOStats.snapshot()`` (requests by kind, bytes read and written) summed over ``volunteers``
    volunteers during ``seconds``."""
    if seconds <= 0 or volunteers < 1:
        raise ValueError("a measurement needs a positive duration and at least 1 volunteer")
    k = HOUR / (seconds * volunteers)
    hour = Rates(requests={kind: n * k for kind, n in snapshot.get("requests", {}).items()},
                 bytes_up=snapshot.get("bytes_written", 0) * k, bytes_down=snapshot.get("bytes_read", 0) * k)
    cost = {}
    for name in prices.providers:
        h = bill(hour.requests, hour.bytes_down, hour.bytes_up, name, prices)
        d = bill({kind: n * 24 for kind, n in hour.requests.items()}, hour.bytes_down * 24, hour.bytes_up * 24,
                 name, prices)
        cost[name] = MeasuredCost(volunteer_hour=h, volunteer_day=d)
    return Measured(volunteers=volunteers, seconds=seconds, volunteer_hour=hour, cost=cost)


def show(e: Estimate, prices: PriceTable, console) -> None:
    """``dedloc cost`` for people: the plan in a line, the traffic, the dollars at each provider."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from .status import duration

    per_hour = HOUR / e.round_s
    plan = f"{e.peers} volunteers × {e.days:g} day{'s' * (e.days != 1)}"
    console.print(Text(f"{e.preset}: {e.n_params:,} parameters in {e.chunks} chunks; {plan} at {e.samples_per_s:g} "
                       f"samples/s each, target {e.target}: a round every {duration(e.round_s)} ({per_hour:,.1f} "
                       f"an hour, {e.rounds:,.0f} in the run)", style="bold"))
    console.print("\nrequests per volunteer-hour and GB per volunteer-day (the scheduler's: per hour, per day)")
    traffic = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for name in ("", "volunteer", "scheduler"):
        traffic.add_column(name, justify="right" if name else "left")
    v, s = e.volunteer_hour, e.scheduler_hour
    for kind in ("get", "put", "head", "list"):
        traffic.add_row(f"{kind.upper()} requests", f"{v.requests[kind]:,.0f}", f"{s.requests[kind]:,.0f}")
    gb = prices.gigabyte / 24
    traffic.add_row("GB up (written)", f"{v.bytes_up / gb:,.2f}", f"{s.bytes_up / gb:,.1f}")
    traffic.add_row("GB down (read: egress)", f"{v.bytes_down / gb:,.2f}", f"{s.bytes_down / gb:,.1f}")
    console.print(traffic)

    console.print(f"dollars at the list prices of {prices.date}")
    dollars = Table(box=box.SIMPLE_HEAD, show_edge=False)
    dollars.add_column("")
    names = list(e.cost)
    for name in names:
        dollars.add_column(name.upper(), justify="right")
    where = "outside the provider's region" if e.scheduler_egress else "in the provider's region"

    def row(label: str, values: list[float], digits: int = 2) -> None:
        dollars.add_row(label, *(f"{x:,.{digits}f}" for x in values))

    c = [e.cost[n] for n in names]
    row("$ per volunteer-day, requests", [sum(x.volunteer_day.requests.values()) for x in c], 3)
    row("$ per volunteer-day, egress", [x.volunteer_day.egress for x in c], 3)
    row("$ per volunteer-day", [x.volunteer_day.total for x in c], 3)
    row(f"$ per day, the scheduler ({where})", [x.scheduler_day.total for x in c])
    row(f"$ storage, {e.storage_gb:,.1f} GB on average", [x.storage for x in c])
    row(f"$ whole run ({plan}, egress included)", [x.run for x in c])
    dollars.add_row("scheduler's share", *(f"{100 * x.scheduler_share:.0f}%" for x in c))
    console.print(dollars)
    console.print(Text("; ".join(f"{n.upper()}: {prices.providers[n].name}" for n in names)
                       + ". Free tiers not counted; docs/cost.md says what is modeled.", style="dim"))
