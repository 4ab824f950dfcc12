"""A volunteer: pull the latest state, accumulate gradients, upload a shard when the round fills.

The only coordination is through the bucket, and a volunteer reads one object of it per poll:
the round view the scheduler publishes (``protocol/view.py``: the newest state, the samples of
the shards it validated, the live peers' pending samples, closed, stopped). A worker uploads
what it has once the validated samples plus the other peers' pending samples plus its own reach
the target; it writes only its own heartbeat and its shards. How often it reads and heartbeats
follows the round (the run's ``cadence``): a share of the time until the round can fill, so
often near the target and seldom far from it. It moves to a new state when the view names one (reading that COMMIT and its
delta), and leaves when the view says the run is stopped. If a peer vanishes, its heartbeat
goes stale, the scheduler stops counting it, and the others upload a second part as soon as
their pending samples are needed: they make up the missing samples. With delayed updates on, a
worker that is waiting for the next state keeps computing on the one it has and counts those
samples (one step stale) toward the next round. In the local-steps mode (``algorithm: diloco``,
docs/diloco.md) the same loop steps the volunteer's own optimizer every ``inner_batch`` samples,
and a shard carries where those steps took the model: the state minus the local parameters.

Without a fresh view (none yet, or unchanged for the run's ``peer_timeout_s`` by this machine's
clock: no scheduler, or it died or is busy reducing), a worker keeps computing and heartbeating but uploads only what its
own samples decide: nothing until its own pending samples alone fill the round (a round it could
fill alone needs nobody's count); it holds them. It still notices new states and the STOP marker
by reading LATEST and STOP itself every ``fallback_s`` (``cadence.poll_max_s``), and once a scheduler publishes
again it uploads as the fresh view says. What a stale view still proves is used: a state newer
than the worker's, a closed round, STOP.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model.data import make_source
from ..model.families import loss_sum
from ..model.flat import FlatLayout
from ..storage.codec import ErrorFeedback
from ..storage.vector import CorruptShard
from ..trust import identity
from . import optim, shard, view as published
from .clock import Clock
from .run import Run, RunError
from .view import RoundView

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sent:
    """One upload of this peer's: ``at`` is when its manifest landed (inf while under way)."""

    round: int
    samples: int
    at: float = math.inf
    job: Future | None = None
    started: float = 0.0  # when it was handed to the transfer thread (the worker's clock)
    state_hash: str = ""  # the COMMIT of the state it was computed on (round ``round``'s)


@dataclass
class Accumulator:
    """Gradient sums in ``model.grad`` for one round, and the samples they came from."""

    round: int
    samples: int = 0
    stale_samples: int = 0
    loss_sum: float = 0.0
    ranges: list[list[int]] = field(default_factory=list)
    unstepped: int = 0  # diloco: samples in ``model.grad`` that no inner step has taken yet


@dataclass(frozen=True)
class Snapshot:
    """A volunteer's progress at one moment, for a display (taken without a bucket call)."""

    peer: str
    state: int | None
    activity: str  # starting | computing | uploading | waiting (for the next state)
    round: int | None  # the round the pending samples are for (state + 1: computed ahead)
    pending: int  # computed and not uploaded
    computed: int
    uploaded: int
    uploads: tuple[tuple[int, str, int], ...]
    target: int
    view: RoundView | None  # round ``state`` as the round view last showed it; None without a fresh one
    bytes_up: int
    bytes_down: int


class Worker:
    """One volunteer's loop (see the module's docstring): it reads the round view (one
    conditional GET) every ``cadence.poll_s(eta)``, computes micro-batches, heartbeats every
    ``cadence.heartbeat_s(eta)`` and uploads when the view's validated and pending samples and
    its own fill the round; the ETA is its own estimate of when the round fills, so it polls
    often only near the target. A view unchanged for ``peer_timeout_s`` is no view: it computes,
    heartbeats and holds its samples (uploading only a round its own samples fill), and reads
    LATEST and STOP itself every ``cadence.poll_max_s``."""

    def __init__(self, run: Run, peer_id: str | None = None, micro_batch: int | None = None,
                 threads: int | None = None, delayed: bool | None = None, poll_s: float | None = None,
                 device: str = "cpu", signer: identity.Ed25519PrivateKey | None = None, precision: str = "fp32",
                 clock: Clock | None = None):
        """``poll_s`` fixes the cadence: a round-view read every ``poll_s`` and a heartbeat every
        three (at most a third of ``peer_timeout_s``; 0: both every step, as lock-step tests
        drive it); None follows the run's ``cadence``. ``precision`` bf16 (diloco only) keeps
        the weights, gradients and inner optimizer state in bfloat16: half the memory, so a
        1B model's volunteer fits a 16 GB GPU (docs/diloco.md)."""
        self.run = run
        self.clock = run.clock if clock is None else clock
        self.peer = peer_id or f"peer-{uuid.uuid4().hex[:8]}"
        self.signer = signer
        _check_enrolled(run, self.peer, signer)
        self.micro_batch = micro_batch or run.config.micro_batch
        self.delayed = run.config.delayed_updates if delayed is None else delayed
        self.cadence = run.config.cadence
        self.poll_s = poll_s  # None: adaptive
        self.fallback_s = self.cadence.poll_max_s if poll_s is None else 5 * poll_s
        self._reader = published.Reader(run.config.peer_timeout_s, self.clock)
        self._speed = 0.0  # this peer's samples per second of wall time (moving average)
        self._closed_seen: float | None = None  # when the view first showed round ``state`` closed
        self._behind = False  # the fresh view is of an older state than this worker's
        self._reduce_s: float | None = None  # from then to the next state, last time
        self._computed_at: float | None = None
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        cfg = run.config
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r}: fp32 or bf16")
        if precision == "bf16" and cfg.algorithm != "diloco":
            raise ValueError("bf16 is for diloco runs: the default algorithm sums a whole round's gradients, "
                             "which bfloat16 would round away")
        self.model = run.build_model().to(self.device, torch.bfloat16 if precision == "bf16" else torch.float32)
        self.flat = FlatLayout(self.model)
        self.source = make_source(run)
        self.feedback = ErrorFeedback(cfg.codec, cfg.block_size)
        # diloco: the inner optimizer and its state stay on this machine (a joiner starts fresh)
        self.inner = None
        if cfg.algorithm == "diloco":
            named = dict(self.model.named_parameters())
            self.inner = optim.torch_optimizer(cfg.optimizer, [named[t.name] for t in self.flat.tensors if t.decay],
                                               [named[t.name] for t in self.flat.tensors if not t.decay])
        self.state: int | None = None
        self._state_hash = ""  # shard.commit_hash of state's COMMIT
        self.stopped = False  # the organizer wrote the run's STOP marker
        self.params = None
        self._base = None  # diloco: where the model's inner steps started, as the model holds it
        self.acc: Accumulator | None = None
        self.cursor = 0
        self._view: RoundView | None = None  # round ``state`` as the last fresh round view showed it
        self._looked = float("-inf")  # clock.monotonic() of the last round-view read
        self._beats: deque[tuple[float, int, int, float, float]] = deque(maxlen=64)  # (time, round, samples, rate, next_s)
        self._sent: deque[_Sent] = deque(maxlen=64)  # this peer's recent uploads
        self._sending: list[_Sent] = []  # those under way
        self._fetching: tuple[int, Future] | None = None  # (state, its download) under way
        # one thread moves the bytes: uploads in order (error feedback), downloads between them;
        # started on the first transfer, ended when the worker leaves
        self._transfers: ThreadPoolExecutor | None = None
        self._abandon = threading.Event()
        self._uploaded: set[int] = set()  # rounds this worker sent a part to
        self._upload_s = 0.0  # how long this peer's last upload took
        self._short_since: tuple[int, float] | None = None  # (round, since when) a second part looked needed
        self._last_progress = 0.0
        self._last_sync = 0.0
        self._rate = (self.clock.monotonic(), 0)
        self.activity = "starting"
        self.uploads: list[tuple[int, str, int]] = []  # (round, shard key, samples) of every upload
        self.uploaded_samples = 0
        self.computed_samples = 0
        self.compute_s = 0.0  # in forward and backward: the share of wall time that is training
        self.started = self.clock.monotonic()

    # state
    def sync(self, latest: int | None = None) -> bool:
        """Move to the newest committed state (LATEST and the COMMITs say which; STOP is read
        too), or to state ``latest`` when the round view names it; True if it changed. This
        waits for the download: the round view's new states are fetched in the background
        (``_prefetch``) instead."""
        if latest is None:
            self._last_sync = self.clock.time()
            self.stopped = self.run.bucket.exists(self.run.keys.stop())
            latest = self.run.latest()
        if self.state is not None and latest <= self.state:
            return False
        try:
            loaded = self._load(latest, self.state, self.params)
        except CorruptShard:
            if self.run.latest() == latest:
                raise
            return self.sync()  # pruned under our feet by newer commits: take the newest
        return loaded is not None and self._install(latest, *loaded)

    def _load(self, latest: int, state: int | None, base) -> tuple[object, dict] | None:
        """The parameters of committed state ``latest`` and its COMMIT: from ``base`` (those of
        ``state``) and the delta when it is the next state, else the snapshot; None if it is not
        committed. Touches nothing of the worker's, so it runs on the transfer thread too."""
        try:
            commit = self.run.commit_of(latest)
        except RunError:  # the view named a state whose COMMIT is not there: only COMMITs count
            log.warning("%s: the round view names state %d, which is not committed", self.peer, latest)
            return None
        except identity.IdentityError as exc:  # a forged COMMIT is no state: keep computing on ours
            log.error("%s: %s", self.peer, exc)
            return None
        if state is not None and latest == state + 1:
            try:
                return self.run.apply_delta(latest, base, commit), commit
            except Exception as exc:  # any mismatch: the snapshot is the truth
                log.warning("%s: delta of state %d unusable (%s); reading the snapshot", self.peer, latest, exc)
        return self.run.load_params(latest, commit), commit

    def _install(self, latest: int, params, commit: dict) -> bool:
        """Make state ``latest`` the one computed on (between micro-batches); its shards will
        name its COMMIT's hash."""
        if self.state is None:
            self.cursor = self._resume_cursor(latest)
        elif latest <= self.state:
            return False
        elif latest > self.state + 1 and self.acc is not None:
            self._drop()  # more than one step behind: those gradients are too stale to use
        if self._closed_seen is not None:
            self._reduce_s, self._closed_seen = self.clock.monotonic() - self._closed_seen, None
        # diloco: the inner steps not yet sent move with the state (their pseudo-gradient stays)
        moved = self.flat.get() - self._base if self.inner is not None and self.acc is not None else None
        self.params, self.state, self._state_hash = params, latest, shard.commit_hash(commit)
        self.flat.set(params if moved is None else params + moved)
        self._base = self._held(params)
        self._view = None
        self._looked = float("-inf")  # the view read before this was of the old state
        self._uploaded = {x for x in self._uploaded if x >= latest}
        self._retarget()
        log.info("%s: at state %d", self.peer, latest)
        return True

    def _prefetch(self, latest: int) -> None:
        """Download state ``latest`` on the transfer thread while this one computes; installed
        by the first step after it lands (``_settle``)."""
        if self._fetching is not None or latest <= self.state:
            return
        self._fetching = (latest, self._transfer(self._load, latest, self.state, self.params))

    def _transfer(self, fn, *args) -> Future:
        if self._transfers is None:
            self._transfers = ThreadPoolExecutor(1, thread_name_prefix=f"{self.peer}-transfers")
        return self._transfers.submit(fn, *args)

    def _retarget(self) -> None:
        acc = self.acc
        if acc is None or acc.round >= self.state:
            return
        if self.delayed and acc.round == self.state - 1 and not acc.stale_samples:
            acc.round, acc.stale_samples = self.state, acc.samples  # missed its round: one step stale
        else:  # closed, or carried once already: some of it would be two steps stale (no shard may say so)
            log.info("%s: dropping %d samples of closed round %d", self.peer, acc.samples, acc.round)
            self._drop()

    def _resume_cursor(self, r: int) -> int:
        """Continue this peer's stream after the samples it already uploaded: those counted up
        to state r (its streams record), and those in manifests of rounds not yet committed."""
        keys = self.run.keys
        end = int(self.run.stream_ends(r).get(self.peer, 0))
        for rr in (r - 1, r):
            if rr < 0:
                continue
            mkeys = self.run.bucket.find(keys.manifests_dir(rr, self.peer))
            for raw in self.run.bucket.read_many(mkeys).values():
                try:
                    m = shard.Manifest.model_validate_json(raw)
                    end = max([end] + [a + c for a, c in m.data.ranges])
                except ValueError:
                    continue
        return end

    # what the others are doing: the round view, one GET per poll
    def view(self) -> RoundView | None:
        """Round ``state`` as the scheduler's round view shows it to this peer, read again once
        ``poll_every()`` has passed; None without a fresh view of this state (then only this
        peer's own samples decide). Reading it moves this peer to a newer state the view names,
        marks it stopped when the view says so, and, with no fresh view, reads LATEST and STOP
        itself every ``fallback_s``."""
        if self.state is None:
            self.sync()
        if self.clock.monotonic() - self._looked < self.poll_every():
            return self._view
        self._looked = self.clock.monotonic()
        bucket, keys = self.run.bucket, self.run.keys
        v = self._reader.read(bucket, keys)
        fresh = self._reader.fresh
        if v is not None:
            self.stopped = self.stopped or v.stopped  # facts even in a stale view: STOP stays,
            if v.state > self.state:  # a state once committed stays committed
                self._prefetch(v.state)
            elif v.state == self.state and v.closed and self._closed_seen is None:
                self._closed_seen = self.clock.monotonic()
        if not (fresh and v.state == self.state) and self._fetching is None \
                and self.clock.time() - self._last_sync >= self.fallback_s:
            self.sync()
        usable = v is not None and v.state == self.state and (fresh or v.closed)
        self._view = self._mine(v) if usable else None
        self._behind = fresh and v.state < self.state  # not published since this state: look again soon
        return self._view

    def eta(self) -> float | None:
        """Seconds until round ``state`` can fill, as this peer sees it: what the validated
        samples and everyone's pending ones lack, at everyone's speed; None if nobody computes."""
        v = self._projected(self._view) if self._view is not None else self._alone(self.state)
        if v.closed:  # being reduced: as long as the last reduction took (unknown: soon)
            since = self.clock.monotonic() - (self._closed_seen or self.clock.monotonic())
            return max(0.0, (self._reduce_s or 0.0) - since)
        acc = self.acc
        mine = acc.samples if acc is not None and acc.round == self.state else 0
        lacking = self.run.config.target_batch_size - v.manifest_samples - v.fresh_samples - mine
        speed = v.samples_per_s + self._speed
        mine_eta = 0.0 if lacking <= 0 else (lacking / speed if speed > 0 else None)
        if v.eta_s is None:  # before the others' heartbeats count, the scheduler may know better
            return mine_eta
        theirs = max(0.0, v.eta_s - max(0.0, self.clock.time() - v.at))
        return theirs if mine_eta is None else min(mine_eta, theirs)

    def poll_every(self) -> float:
        if self.poll_s is not None:
            return self.poll_s
        return self.cadence.poll_min_s if self._behind else self.cadence.poll_s(self.eta())

    def heartbeat_every(self) -> float:
        timeout = self.run.config.peer_timeout_s
        if self.poll_s is not None:
            return min(3 * self.poll_s, timeout / 3)
        return self.cadence.heartbeat_s(self.eta(), timeout)

    def _mine(self, v: published.View) -> RoundView:
        """The published view less this peer's own heartbeat in it, plus this peer's shards it
        cannot show yet. Which heartbeat the scheduler read (between ``v.at`` and
        ``v.written_at``) is not known exactly: the newest one written before ``v.at`` or any
        written while it read, so the largest pending count among those is taken out. The
        others' pending samples are never overestimated: this peer never uploads early on its
        own samples. Its shards finished after ``v.at`` are added (the view listed before them)."""
        r, cfg = self.state, self.run.config
        pending, speed, counted = 0, 0.0, False
        live = [b for b in self._beats if b[1] == r and abs(v.at - b[0]) < cfg.peer_timeout_s]
        maybe = [b for b in live if b[0] <= v.at][-1:] + [b for b in live if v.at < b[0] <= v.written_at]
        if maybe and not v.closed:  # as the scheduler counted it: projected to v.at
            ahead, target = cfg.cadence.heartbeat_max_s, cfg.target_batch_size
            pending, counted = max(published.project(b[2], b[3], v.at - b[0], min(ahead, b[4]), target)
                                   for b in maybe), True
            speed = min(max(maybe[-1][3], 0.0), published.MAX_PEER_SPEED)
        unseen = sum(x.samples for x in self._sent if x.round == r and x.at > v.at)
        return published.for_worker(v, pending, speed, counted, unseen)

    def _alone(self, r: int) -> RoundView:
        """Round r without a fresh view: nobody's counts but this peer's own shards."""
        return RoundView(manifest_samples=sum(x.samples for x in self._sent if x.round == r), at=self.clock.time())

    def _projected(self, v: RoundView) -> RoundView:
        """The others' pending samples grow at their speed since the scheduler counted them
        (``v.at``, until their next heartbeats are due: at most ``heartbeat_max_s``, so a skewed
        clock costs little): between reads, and with a view a scheduler poll old, a worker still
        sees the round fill."""
        grown = published.project(v.fresh_samples, v.samples_per_s, self.clock.time() - v.at,
                                  v.horizon_s, self.run.config.target_batch_size)
        return dataclasses.replace(v, fresh_samples=grown)

    def _note_speed(self, n: int) -> None:
        """This peer's speed for the ETA: samples per second of wall time, uploads and waits
        included, smoothed over about ten micro-batches."""
        now = self.clock.monotonic()
        if self._computed_at is not None:
            rate = n / max(1e-6, now - self._computed_at)
            self._speed = rate if self._speed == 0 else 0.9 * self._speed + 0.1 * rate
        self._computed_at = now

    # work
    def step(self) -> bool:
        """One decision, and one micro-batch if there is work. False while only waiting."""
        if self.state is None:
            self.sync()
        self._settle()
        seen = self.view()
        r, target = self.state, self.run.config.target_batch_size
        v = self._projected(seen) if seen is not None else self._alone(r)
        full = v.closed or v.manifest_samples >= target or self._fetching is not None  # a newer state exists
        acc = self.acc
        if full and acc is not None and acc.round == r:
            if self.delayed and not acc.stale_samples:
                acc.round, acc.stale_samples = r + 1, acc.samples
            else:  # may still make it before CLOSE; late otherwise. Samples carried once already
                self._upload(acc)  # are not carried again: they would be two steps stale
        ahead = full and acc is not None and acc.round == r + 1 and acc.samples >= target
        if full and (not self.delayed or ahead):  # a round's worth of stale samples is enough: a
            self._report(force=False)  # shard may claim at most a few (shard.max_claim)
            self.activity = "waiting"
            return False
        self.activity = "computing"
        self._compute(r + 1 if full else r)
        acc = self.acc
        self._report(force=False)
        sending = any(x.round == r for x in self._sending)  # a second part waits for the first to land
        wanted = acc.round == r and not sending and self._should_upload(v, acc.samples, target,
                                                                         first=r not in self._uploaded)
        if not wanted:
            self._short_since = None
        elif self._still_short(r):
            self._upload(acc)
        return True

    def _still_short(self, r: int) -> bool:
        """A second part of round r goes only once it has looked needed for twice this peer's
        last upload time: the others' shards under way (as long to send as this peer's, about)
        land first, and the samples are carried to the next round instead of arriving after
        CLOSE. A first part goes at once; so does any part in lock-step (``poll_s`` 0)."""
        if r not in self._uploaded or self.poll_s == 0:
            return True
        now = self.clock.monotonic()
        if self._short_since is None or self._short_since[0] != r:
            self._short_since = (r, now)
        return now - self._short_since[1] >= 2 * self._upload_s

    @staticmethod
    def _should_upload(v: RoundView, mine: int, target: int, first: bool) -> bool:
        """Upload once the round can fill. A peer that already uploaded sends another part only
        when its pending samples are needed: they alone cover what the manifests lack, or the
        live peers' pending samples fall short without them (a peer vanished)."""
        expected = v.manifest_samples + v.fresh_samples
        if first:
            return expected + mine >= target
        return mine >= target - v.manifest_samples or expected < target <= expected + mine

    def _compute(self, round_: int) -> None:
        if self.acc is None:
            self.acc = Accumulator(round=round_)
            self.model.zero_grad(set_to_none=False)
        acc, n = self.acc, self.micro_batch
        t0 = time.perf_counter()
        acc.loss_sum += self.train(self.cursor, n)
        self.compute_s += time.perf_counter() - t0
        if acc.ranges and acc.ranges[-1][0] + acc.ranges[-1][1] == self.cursor:
            acc.ranges[-1][1] += n
        else:
            acc.ranges.append([self.cursor, n])
        acc.samples += n
        acc.unstepped += n
        acc.stale_samples += n if round_ > self.state else 0
        self.cursor += n
        self.computed_samples += n
        self._note_speed(n)
        if self.inner is not None and acc.unstepped >= self.run.config.inner_batch:
            self._inner_step()

    def _inner_step(self) -> None:
        """diloco: one optimizer step on this volunteer's model, on the mean gradient of the
        samples since the last one. The learning rate follows the round, as in the default
        algorithm (its schedule counts rounds): the same for every volunteer, whatever its
        speed or arrival."""
        acc = self.acc
        if not acc.unstepped:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in self.model.parameters():  # one the batch never reached steps on zero, as at an aggregator
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.div_(acc.unstepped)
        for group in self.inner.param_groups:
            group["lr"] = optim.lr_at(self.run.config.optimizer, self.state + 1)
        self.inner.step()
        self.model.zero_grad(set_to_none=False)
        acc.unstepped = 0
        self.compute_s += time.perf_counter() - t0

    def train(self, cursor: int, n: int) -> float:
        """Forward and backward on samples ``cursor`` to ``cursor + n`` of this peer's stream,
        gradients summed into the model's; the summed loss. (The coordination benchmark
        replaces it with a timed sleep: everything else is the worker's own code.)"""
        batch = {k: v.to(self.device) for k, v in self.source.batch(self.peer, cursor, n).items()}
        loss = loss_sum(self.model, batch)
        loss.backward()
        return loss.item()  # waits for the device: the caller's timer covers the whole step

    def _upload(self, acc: Accumulator) -> None:
        """Send ``acc`` as a shard on the transfer thread: its gradient is copied out (the
        copy is what is sent) and the model's gradients are zeroed for the next part. Until the
        manifest lands its samples count as this peer's pending (heartbeat) and unseen shards
        (round view), so nobody reads them as missing."""
        if self.inner is not None:  # diloco: the pseudo-gradient, state minus where the inner steps went
            self._inner_step()
            update = self._base - self.flat.get()
        else:  # the gradient sum, divided by the samples on the transfer thread
            update = self.flat.grad()
        sent = _Sent(acc.round, acc.samples, started=self.clock.time(), state_hash=self._state_hash)  # acc.round is self.state
        self._uploaded.add(acc.round)
        self._short_since = None
        self._sent.append(sent)
        if self._view is not None:  # the view in hand counts it until the next read does
            self._view = dataclasses.replace(self._view, manifest_samples=self._view.manifest_samples + sent.samples)
        data = shard.DataRef(stream=self.peer, ranges=[tuple(x) for x in acc.ranges])
        sent.job = self._transfer(self._send, update, acc.round, acc.samples, acc.loss_sum / acc.samples,
                                  data, acc.stale_samples, sent)
        self._sending.append(sent)
        self._drop()
        self._report(force=True, round_=sent.round)  # the others count these samples as on their way

    def _send(self, update, r: int, samples: int, loss: float, data: shard.DataRef, stale: int, sent: "_Sent") -> str:
        """On the transfer thread: encode (the error feedback is this thread's alone, in
        upload order) and upload, chunks first and the manifest last."""
        if self.inner is None:
            update /= samples  # the mean gradient
        arrays = self.feedback.encode(update)
        part = f"{int(self.clock.time() * 1000):013d}-{uuid.uuid4().hex[:6]}"
        key = shard.upload(self.run, r, self.peer, part, arrays, samples, loss, data, stale_samples=stale,
                           signer=self.signer, abandoned=self._abandon.is_set, state_hash=sent.state_hash)
        sent.at = self.clock.time()
        return key

    def _settle(self, wait: bool = False) -> None:
        """Account for the transfers that finished (all of them with ``wait``): uploads are
        logged and heartbeaten, a downloaded state is installed. A transfer that failed after
        its retries raises here, on the worker's thread."""
        for sent in list(self._sending):
            if not (wait or sent.job.done()):
                continue
            activity, self.activity = self.activity, "uploading" if not sent.job.done() else self.activity
            try:
                key = sent.job.result()
            finally:
                self.activity = activity
            self._sending.remove(sent)
            self._upload_s = max(0.0, sent.at - sent.started) if key is not None else self._upload_s
            self.uploads.append((sent.round, key, sent.samples))
            self.uploaded_samples += sent.samples
            log.info("%s: uploaded %d samples to round %d (%s)", self.peer, sent.samples, sent.round, key)
            self._looked = float("-inf")  # the next step reads the view again, this shard counted in
            self._report(force=True, round_=sent.round)
        if self._fetching is not None and (wait or self._fetching[1].done()):
            (latest, job), self._fetching = self._fetching, None
            try:
                loaded = job.result()
            except CorruptShard:
                self.sync()  # pruned under our feet by newer commits: take the newest
                return
            if loaded is not None:
                self._install(latest, *loaded)

    def flush(self) -> None:
        """Wait for every transfer under way and account for it (lock-step drivers, leaving)."""
        self._settle(wait=True)

    def _drop(self) -> None:
        """Forget the accumulated samples; in diloco the inner steps too (back to the state)."""
        self.acc = None
        self.model.zero_grad(set_to_none=False)
        if self.inner is not None and self.params is not None:
            self.flat.set(self.params)
            self._base = self._held(self.params)

    def _held(self, params):
        """``params`` as the model holds them: themselves in float32, rounded in bfloat16 (so a
        pseudo-gradient is only what the inner steps moved)."""
        if self.inner is None:
            return None
        dtype = next(self.model.parameters()).dtype
        return params if dtype == torch.float32 else torch.from_numpy(params).to(dtype).float().numpy()

    def _report(self, force: bool, round_: int | None = None) -> None:
        """Heartbeat for the round being accumulated: pending samples and speed."""
        now = self.clock.time()
        if not force and now - self._last_progress < self.heartbeat_every():
            return
        acc = self.acc
        r = round_ if round_ is not None else (acc.round if acc is not None else self.state)
        t0, c0 = self._rate
        rate = (self.computed_samples - c0) / max(1e-9, self.clock.monotonic() - t0)
        self._rate = (self.clock.monotonic(), self.computed_samples)
        io = self.run.bucket.stats
        sending = sum(x.samples for x in self._sending if x.round == r)  # pending until their manifests land
        samples = (acc.samples if acc and acc.round == r else 0) + sending
        next_s = self.heartbeat_every()
        self._beats.append((now, r, samples, rate, next_s))
        self.run.bucket.write_json(self.run.keys.progress(r, self.peer), {
            "peer": self.peer, "round": r, "samples": samples, "sending": sending,
            "samples_per_s": rate, "next_s": next_s, "time": now, "uploaded_samples": self.uploaded_samples,
            "compute_s": self.compute_s, "wall_s": self.clock.monotonic() - self.started,
            "bytes_up": io.bytes_written, "bytes_down": io.bytes_read})
        self._last_progress = now

    def snapshot(self) -> Snapshot:
        """What this volunteer is doing; safe to call from a display's thread."""
        acc, io = self.acc, self.run.bucket.stats
        return Snapshot(peer=self.peer, state=self.state, activity=self.activity,
                        round=acc.round if acc is not None else self.state,
                        pending=acc.samples if acc is not None else 0, computed=self.computed_samples,
                        uploaded=self.uploaded_samples, uploads=tuple(self.uploads),
                        target=self.run.config.target_batch_size, view=self._view,
                        bytes_up=io.bytes_written, bytes_down=io.bytes_read)

    def leave(self) -> None:
        """Finish the uploads under way, then tell the others this peer's pending samples will
        not come."""
        pool, self._transfers = self._transfers, None
        try:
            self.flush()
        except BaseException:  # a second Ctrl-C: the upload under way ends before its manifest
            self._abandon.set()
            self._sending.clear()
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=not self._abandon.is_set())
            if self.state is not None:
                self._drop()
                self._report(force=True)

    def serve(self, until_round: int | None = None, stop: Callable[[], bool] | None = None) -> int:
        """Work until state ``until_round`` is committed, the run is stopped, or ``stop()`` says
        so (asked between steps: an upload under way completes first); returns the last state."""
        self.started = self.clock.monotonic()
        self.sync()
        try:
            while not (self.stopped or (until_round is not None and self.state >= until_round)
                       or (stop is not None and stop())):
                if not self.step():
                    self._computed_at = None  # waiting is not computing: the speed counts work only
                    self.clock.sleep(self.poll_every() / 4)
        finally:
            self.leave()
        return self.state


def _check_enrolled(run: Run, peer: str, signer: identity.Ed25519PrivateKey | None) -> None:
    """In a run that requires signatures, fail at start, not with every shard rejected."""
    org = run.config.organizer_key
    if org is None:
        return
    if signer is None:
        raise identity.IdentityError(f"run {run.name!r} admits only signed shards: pass --key "
                                     "(make one with `dedloc keygen`)")
    roster = identity.read_roster(run.bucket, run.name, org)
    mine, problem = identity.public(signer), "nobody is enrolled yet"
    if roster is not None:
        try:
            problem = None if roster.key_of(peer) == mine else f"peer {peer!r} is enrolled with another key"
        except identity.IdentityError as exc:
            problem = str(exc)
    if problem:
        raise identity.IdentityError(f"run {run.name!r}: {problem}; send the organizer your volunteer "
                                     f"name and your public key {mine}")
