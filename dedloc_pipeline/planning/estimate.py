"""A collaboration's bill, two ways in: ``estimate`` models a planned run from the protocol itself,
``measured`` prices what ``IOStats`` counted. Both end in ``prices.bill``.

``estimate`` takes the round's length from the target and the peers' speed, the volunteers'
round-view reads and heartbeats from the run's ``Cadence`` as the round's ETA falls, and every
shard upload, state download and scheduler step from the request model (``requests.Traffic``,
on the run's own vector formats and optimizer slots: ``planned.PlannedRun``).

Torch-free: ``dedloc cost`` starts without loading the model.
"""

from __future__ import annotations

import datetime
import math
from typing import Mapping

from pydantic import BaseModel, Field

from ..checks import draw
from ..organizer.lease import LEASE_S, RENEW
from ..protocol import view
from ..protocol.config import RunConfig
from ..protocol.view import View
from .planned import PlannedRun
from .prices import PRICES, Dollars, PriceTable, bill
from .requests import Requests, Traffic

HOUR, DAY, MONTH_DAYS = 3600.0, 86400.0, 30.0

# Bytes per parameter of one shard (up) and one parameter delta (down), from real training
# (docs/benchmarks.md, IOStats, 2026-11-30): benchmark 1 (tiny at sequence 128, 64-90 samples a
# shard) for the default int8 shards and int4 deltas, benchmark 2 (sequence 64) for the others,
# benchmark 9 (diloco's causal-tiny pseudo-gradients and deltas) for sparse.
# Not derived from the codec: a random gradient compresses worse than a real one (int8: 0.96).
SHARD_BYTES_PER_PARAM = {"none": 2.61, "fp16": 1.07, "int8": 0.66, "int4": 0.226, "sparse": 0.031}
DELTA_BYTES_PER_PARAM = {"none": 2.98, "fp16": 1.42, "int8": 0.831, "int4": 0.47, "sparse": 0.035}
DENSE_BYTES_PER_PARAM = 4.0  # fp32 parameters, optimizer state, reduced gradient: Blosc barely shrinks them
HEARTBEAT_BYTES = 300  # protocol/view.py: an honest heartbeat is ~300 bytes
# Measured: samples/s of one volunteer, where a benchmark has it. tiny: benchmark 1's limit, one
# single-thread process per core (35.7 samples/s on 2 cores). sahajbert on a GPU is not measured yet.
SAMPLES_PER_S = {"tiny": 17.8}
# Seconds from CLOSE to COMMIT: benchmark 5's fit (validate, reduce, apply, commit; one scheduler
# with 2 threads on a warm file:// bucket): 0.25 + 1.1e-8 * peers * parameters. S3 adds transfer time.
REDUCE_S = (0.25, 1.1e-8)


class Rates(BaseModel):
    requests: dict[str, float] = Field(description="per hour, by kind")
    bytes_up: float = Field(description="per hour, written to the bucket (its ingress)")
    bytes_down: float = Field(description="per hour, read from the bucket (its egress)")


class ProviderCost(BaseModel):
    volunteer_day: Dollars
    scheduler_day: Dollars
    aggregator_day: Dollars | None = Field(None, description="a volunteer aggregator's, besides its volunteer-day")
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
    aggregators: int = Field(0, description="volunteer aggregators, two to a part (0: the organizer aggregates)")
    aggregator_hour: Rates | None = None
    audited_chunks: int = Field(0, description="with volunteer aggregators: chunks of each exchange the organizer's "
                                "audits recompute a round (close.audit of each part's, one at least)")
    audit_survival: float | None = Field(None, description="the chance that a lie over one chunk of a part survives "
                                         "a round's audit (none survives over a whole part)")
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
             delta_bytes_per_param: float | None = None, aggregators: int = 0) -> Estimate:
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
    and prunes. With ``aggregators`` (volunteer aggregators, docs/aggregators.md; all of them
    settling every part) the scheduler validates, settles the parts and commits: the reduction's
    and the state's reads and writes are theirs, each doing two parts in ``aggregators``, but for
    the organizer's audits of ``close.audit`` of each part's chunks in each exchange (trusted
    aggregators: the steady state).
    """
    if peers < 1 or days <= 0:
        raise ValueError("a planned run needs at least 1 peer and more than 0 days")
    if aggregators == 1 or aggregators < 0:
        raise ValueError("volunteer aggregators come two to a part: at least 2 (or 0: the organizer aggregates)")
    speed = SAMPLES_PER_S.get(config.preset) if samples_per_s is None else samples_per_s
    if speed is None:
        raise ValueError(f"no measured speed for preset {config.preset!r}: give the volunteers' samples/s "
                         "(--samples-per-s)")
    if speed <= 0 or uplink_mbit_s <= 0 or (scheduler_poll_s is not None and scheduler_poll_s <= 0):
        raise ValueError("samples/s, the uplink and the scheduler's poll interval must be positive")
    traffic = Traffic(PlannedRun(config, n))
    cad, timeout = config.cadence, config.peer_timeout_s
    n = traffic.n
    shard_b = n * (SHARD_BYTES_PER_PARAM[config.codec] if shard_bytes_per_param is None else shard_bytes_per_param)
    delta_b = n * (DELTA_BYTES_PER_PARAM[config.param_codec] if delta_bytes_per_param is None
                   else delta_bytes_per_param)
    fill_s = config.target_batch_size / (peers * speed)
    upload_s = shard_b * 8 / (uplink_mbit_s * 1e6)
    reduce_s = REDUCE_S[0] + REDUCE_S[1] * peers * n if reduce_s is None else reduce_s
    settle_s = upload_s + reduce_s
    round_s = max(fill_s, settle_s) if config.delayed_updates else fill_s + settle_s
    open_s = round_s - settle_s

    step_s = (config.micro_batch if micro_batch is None else micro_batch) / speed

    def between_steps(interval: float) -> float:
        """A computing volunteer looks at its clock between micro-batches."""
        return math.ceil(interval / step_s - 1e-9) * step_s

    def poll(eta: float) -> float:
        return between_steps(cad.poll_s(eta))

    def sched_poll(eta: float) -> float:
        return cad.scheduler_s(eta) if scheduler_poll_s is None else scheduler_poll_s

    # per round, the scheduler: polls until CLOSE (the first reads the opening COMMIT and every
    # live heartbeat, later ones the heartbeats written since), then the round's own work
    polls = max(1.0, _count(sched_poll, open_s) + upload_s / sched_poll(0.0))
    # a volunteer heartbeats as it starts computing a round, then every keep-alive (a share of the
    # round) while its speed holds; a shard's landing needs none (heartbeat.due)
    beats = math.ceil(round_s / between_steps(cad.heartbeat_s(round_s)) - 1e-9)
    changed = peers * beats
    # the view is written when a poll read something new: each wave of heartbeats (a round's
    # start, each keep-alive) and of manifests reaches the scheduler over about two polls, the
    # peers' clocks apart; and a keep-alive of its own
    view_writes = min(polls, 2 * (beats + 1) + round_s / view.keepalive_s(timeout, cad, round_s))
    roster = int(config.organizer_key is not None) * min(polls, peers)  # read when manifests are new
    listed = traffic.volunteer_objects(peers, peers)
    # with volunteer aggregators, the scheduler lists every 2 s while they compute and reveal, and
    # in the gradient mode they check the shards' contents too: it reads none of their chunks
    unread = bool(aggregators) and config.algorithm != "diloco"
    audited = traffic.audited(config.close.audit)
    finish = (traffic.checked_finish(max(1.0, reduce_s / 2.0)) + Requests(get=aggregators)  # and their offers
              + traffic.audits(peers, audited) if aggregators else traffic.finish(peers))
    sched = (traffic.scheduler_poll(0, 0, view=False, listed=listed) * polls + Requests(put=view_writes, get=roster)
             + Requests(get=1 + changed + peers) + traffic.closing(peers, unread) + finish
             + traffic.prune_steady(peers, peers) + traffic.between_rounds()
             + traffic.lease_renewal() * (round_s / (LEASE_S * RENEW)))
    view_b = _view_bytes(config)
    dense = DENSE_BYTES_PER_PARAM * n
    # the organizer steps from the gradient and state it wrote, where they fit (vector.Kept); LAMB's sums read it
    state_reads = (0 if traffic.kept else 1 + 2 + traffic.slots) + (1 + traffic.slots if traffic.lamb else 0)
    optim_writes = traffic.slots + int(traffic.lossy_delta)
    # the reduction's reads of the shards and the state's reads and writes are the organizer's, or
    # the volunteer aggregators' (each part twice: two to a part), as is the shards' validation
    # in the gradient mode (checked part by part as they are read for the reduction)
    aggregation_down = peers * shard_b + state_reads * dense
    aggregation_up = (2 + optim_writes) * dense + delta_b
    # the audits (checks/audit.py) read their chunks of every shard in each exchange, of the state
    # for LAMB's sums and the answers, and of the answers' objects
    audit_down = audited / traffic.chunks * (peers * shard_b * (int(unread) + int(traffic.lamb) + 1)
                                             + (1 + traffic.slots) * dense * int(traffic.lamb)
                                             + (2 + traffic.slots + 1 + optim_writes) * dense + delta_b)
    sched_down = (traffic.commit_bytes(peers) + changed * HEARTBEAT_BYTES + peers * traffic.manifest_bytes()
                  + (0 if unread else peers * shard_b) + (audit_down if aggregators else aggregation_down))
    close_b = 200 + peers * traffic.manifest_bytes()
    sched_up = view_writes * view_b + close_b + (0 if aggregators else aggregation_up) + traffic.commit_bytes(peers)
    share = 2 / aggregators if aggregators else 0.0  # of the parts, each aggregator's
    aggregator = traffic.aggregating(peers, share * len(traffic.parts))
    # an aggregator holds its answer in memory: no reduced scratch, and it reads what it steps
    agg_down = share * (peers * shard_b + (1 + optim_writes) * dense)
    agg_up = share * ((1 + optim_writes) * dense + delta_b)

    # per round and volunteer; a volunteer reads the view at once when its upload lands.
    # A view read is a conditional GET: it carries a body only when the scheduler wrote one since.
    reads_open = _count(poll, open_s) + upload_s / poll(0.0) + 1

    # the round full: computing ahead, a volunteer reads at a share of what the last reduction
    # took, less the time since, or of the time it has waited, whichever is longer (Worker.poll_every);
    # waiting, at a share of what is left
    closed_reads = _count(lambda eta: between_steps(cad.poll_s(max(eta, reduce_s - eta))), reduce_s) \
        if config.delayed_updates else _count(cad.poll_s, reduce_s)
    fallbacks = max(0.0, reduce_s - timeout) / cad.poll_max_s  # the view unchanged: LATEST and STOP
    volunteer = (Requests(get=reads_open + closed_reads, put=beats)
                 + Requests(get=1, head=2) * fallbacks + traffic.shard_upload() + traffic.state_download())
    vol_up = shard_b + traffic.manifest_bytes() + beats * HEARTBEAT_BYTES
    vol_down = delta_b + min(reads_open, view_writes) * view_b + traffic.commit_bytes(peers)

    per_hour, per_day = HOUR / round_s, DAY / round_s
    vol_hour = Rates(requests=(volunteer * per_hour).as_dict(), bytes_up=vol_up * per_hour,
                     bytes_down=vol_down * per_hour)
    sched_hour = Rates(requests=(sched * per_hour).as_dict(), bytes_up=sched_up * per_hour,
                       bytes_down=sched_down * per_hour)
    agg_hour = Rates(requests=(aggregator * per_hour).as_dict(), bytes_up=agg_up * per_hour,
                     bytes_down=agg_down * per_hour) if aggregators else None

    # storage: the kept states and rounds, plus the checkpoints and the ledger, which grow
    rounds = days * DAY / round_s
    state_b = (1 + optim_writes) * dense + delta_b
    round_b = peers * (shard_b + traffic.manifest_bytes() + HEARTBEAT_BYTES) + dense
    kept = config.keep_states * (state_b + round_b)
    grows = (rounds / config.checkpoint_every * (1 + optim_writes) * dense
             + rounds * (close_b + traffic.commit_bytes(peers)))
    stored_gb = (kept + grows / 2) / prices.gigabyte
    gb_months = stored_gb * days / MONTH_DAYS

    cost = {}
    for name in prices.providers:
        vd = bill((volunteer * per_day).as_dict(), vol_down * per_day, vol_up * per_day, name, prices)
        sd = bill((sched * per_day).as_dict(), sched_down * per_day * scheduler_egress, sched_up * per_day,
                  name, prices)
        ad = bill((aggregator * per_day).as_dict(), agg_down * per_day, agg_up * per_day, name, prices) \
            if aggregators else None
        storage = bill({}, 0, 0, name, prices, gb_months=gb_months).storage
        run = peers * days * vd.total + days * sd.total + aggregators * days * (ad.total if ad else 0.0) + storage
        cost[name] = ProviderCost(volunteer_day=vd, scheduler_day=sd, aggregator_day=ad, storage=storage, run=run,
                                  scheduler_share=days * sd.total / run if run else 0.0)
    return Estimate(preset=config.preset, n_params=n, chunks=traffic.chunks, peers=peers, days=days,
                    samples_per_s=speed, target=config.target_batch_size, round_s=round_s, open_s=open_s,
                    settle_s=settle_s, rounds=rounds, view_reads_per_round=reads_open + closed_reads,
                    heartbeats_per_round=beats, scheduler_polls_per_round=polls, volunteer_hour=vol_hour,
                    scheduler_hour=sched_hour, aggregators=aggregators, aggregator_hour=agg_hour,
                    audited_chunks=audited if aggregators else 0,
                    audit_survival=_survival(max(traffic.parts), config.close.audit) if aggregators else None,
                    scheduler_egress=scheduler_egress, storage_gb=stored_gb,
                    storage_gb_months=gb_months, prices_date=prices.date, cost=cost)


def _survival(n: int, fraction: float) -> float:
    """The chance that a lie over one of a part's ``n`` chunks survives an audit of ``fraction`` of them."""
    return draw.survival(n, draw.count(n, fraction), 1)


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

