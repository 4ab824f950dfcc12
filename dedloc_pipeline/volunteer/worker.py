"""A volunteer: pull the latest state, accumulate gradients, upload a shard when the round fills.

The only coordination is through the bucket, and a volunteer reads one object of it per poll:
the round view the scheduler publishes (``protocol/view.py``: the newest state, the samples of
the shards it validated, the live peers' pending samples, closed, stopped). A worker uploads
what it has once the validated samples plus the other peers' pending samples plus its own reach
the target (``volunteer/upload_policy.py``); it writes only its own heartbeat
(``protocol/heartbeat.py``) and its shards. How often it reads follows the round (the run's
``cadence``): a share of the time until the round can fill, so often near the target and seldom
far from it. A heartbeat is a projection of its count, written when the count strays from it
and as a keep-alive a share of a round after the last. If a peer vanishes, its heartbeat goes stale, the scheduler stops
counting it, and the others upload a second part as soon as their pending samples are needed:
they make up the missing samples.

This module is the loop (``step``, ``serve``, ``leave``) over its pieces: the state it follows
and the round view of it (``volunteer/follower.py``: new states, STOP, the stale-view fallback),
what it accumulated (``compute/accumulator.py``: gradient sums, diloco's inner steps, samples
carried once as one step stale with delayed updates), its transfers on one background thread
(``volunteer/transfers.py``) and the upload rule (``volunteer/upload_policy.py``).

Without a fresh view (none yet, or unchanged for the run's ``peer_timeout_s`` by this machine's
clock: no scheduler, or it died or is busy reducing), a worker keeps computing and heartbeating
but uploads only what its own samples decide: nothing until its own pending samples alone fill
the round (a round it could fill alone needs nobody's count); it holds them. Once a scheduler
publishes again it uploads as the fresh view says.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..compute.accumulator import Accumulation, Accumulator
from ..model.data import make_source
from ..model.families import loss_sum
from ..protocol import heartbeat, shard, view as published
from ..protocol.clock import Clock
from ..protocol.heartbeat import Heartbeat
from ..protocol.run import Run
from ..protocol.view import RoundView
from ..trust import identity
from . import joining, upload_policy
from .follower import Follower
from .transfers import Transfers

log = logging.getLogger(__name__)
# target batches a worker computes ahead, at most, while the round before is sent, closed, reduced
# and downloaded: on a slow uplink one upload outlasts computing a target, and a worker holding
# less would wait idle; all of it counts in the next round, one step stale (validation.max_claim)
AHEAD = 2


@dataclass(frozen=True)
class Progress:
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
    scheduler: str | None = None  # what is wrong with the scheduler, as this peer sees it (None: nothing)
    fetching: int | None = None  # a newer state, committed, being downloaded
    view_age_s: float | None = None  # since ``view`` was read: the others as of then (read seldom far from the target)


class Worker:
    """One volunteer's loop (see the module's docstring): it reads the round view (one
    conditional GET) every ``cadence.poll_s(eta)``, computes micro-batches, heartbeats when
    ``heartbeat.due`` says (keep-alive: ``cadence.heartbeat_s(round_s)``) and uploads when the
    view's validated and pending samples and its own fill the round; the ETA is its own
    estimate of when the round fills, so it polls often only near the target. A view unchanged
    for ``peer_timeout_s`` is no view: it computes, heartbeats and holds its samples (uploading
    only a round its own samples fill), and reads LATEST and STOP itself every
    ``cadence.poll_max_s``. Its pieces: the state it follows
    (``follower``), what it accumulated (``local``), its transfers (``transfers``) and the
    rounds it sent parts to (``parts``)."""

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
        joining.check_enrolled(run, self.peer, signer)
        joining.check_not_live(run, self.peer, self.clock)
        cfg = run.config
        self.micro_batch = micro_batch or cfg.micro_batch
        self.delayed = cfg.delayed_updates if delayed is None else delayed
        self.poll_s = poll_s  # None: adaptive
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r}: fp32 or bf16")
        if precision == "bf16" and cfg.algorithm != "diloco":
            raise ValueError("bf16 is for diloco runs: the default algorithm sums a whole round's gradients, "
                             "which bfloat16 would round away")
        model = run.build_model().to(self.device, torch.bfloat16 if precision == "bf16" else torch.float32)
        self.precision = precision
        self.local = Accumulation(model, cfg)
        self.source = make_source(run)
        self.transfers = Transfers(run, self.peer, self.clock, signer, mean=self.local.inner is None)
        fallback_s = cfg.cadence.poll_max_s if poll_s is None else 5 * poll_s
        self.parts = upload_policy.Parts(self.clock, lockstep=poll_s == 0)
        self.follower = Follower(run, self.peer, self.clock, self.transfers, self.local, self.parts, self.delayed,
                                 fallback_s)
        self._beats: deque[Heartbeat] = deque(maxlen=64)  # this peer's recent heartbeats
        self._speed = 0.0  # this peer's samples per second of wall time (moving average)
        self._computed_at: float | None = None
        self.activity = "starting"
        self.uploads: list[tuple[int, str, int]] = []  # (round, shard key, samples) of every upload
        self.uploaded_samples = 0
        self.computed_samples = 0
        self.started = self.clock.monotonic()

    # the pieces' state, as the drivers, displays and tests read it
    model = property(lambda self: self.local.model)
    flat = property(lambda self: self.local.flat)
    state = property(lambda self: self.follower.state)
    params = property(lambda self: self.follower.params)
    stopped = property(lambda self: self.follower.stopped)
    compute_s = property(lambda self: self.local.compute_s)

    @property
    def acc(self) -> Accumulator | None:
        return self.local.acc

    @property
    def cursor(self) -> int:
        return self.local.cursor

    @cursor.setter
    def cursor(self, at: int) -> None:
        self.local.cursor = at

    def sync(self, latest: int | None = None) -> bool:
        """Move to the newest committed state, or to state ``latest`` (``Follower.sync``)."""
        return self.follower.sync(latest)

    # what the others are doing: the round view, one GET per poll
    def view(self) -> RoundView | None:
        """Round ``state`` as the scheduler's round view shows it to this peer, read again once
        ``poll_every()`` has passed (``Follower.read``); None without a fresh view of this state
        (then only this peer's own samples decide)."""
        if self.state is None:
            self.sync()
        if self.clock.monotonic() - self.follower.looked < self.poll_every():
            return self.follower.view
        return self.follower.read(self._mine)

    def _mine(self, v: published.View) -> RoundView:
        cfg = self.run.config
        return upload_policy.from_view(v, self.state, self._beats, self.transfers.sent, cfg.peer_timeout_s,
                                  cfg.cadence.heartbeat_max_s, cfg.target_batch_size)

    def _round(self) -> RoundView:
        """Round ``state`` as this peer sees it now: the view in hand projected, or its own shards."""
        f, target = self.follower, self.run.config.target_batch_size
        if f.view is not None:
            return upload_policy.projected(f.view, self.clock.time(), target)
        return upload_policy.without_view(f.state, self.transfers.sent, self.clock.time())

    def eta(self) -> float | None:
        """Seconds until round ``state`` can fill, as this peer sees it: what the validated
        samples and everyone's pending ones lack, at everyone's speed (``view.eta``); None if
        nobody computes. The scheduler's own ETA, counted down, bounds it."""
        v = self._round()
        if v.closed:  # being reduced: as long as the last reduction took
            return self.follower.reduce_left()
        acc = self.acc
        mine = acc.samples if acc is not None and acc.round == self.state else 0
        mine_eta = published.eta(self.run.config.target_batch_size, v.manifest_samples, v.fresh_samples + mine,
                                 v.samples_per_s + self._speed, closed=False)
        if v.eta_s is None:  # before the others' heartbeats count, the scheduler may know better
            return mine_eta
        theirs = max(0.0, v.eta_s - max(0.0, self.clock.time() - v.at))
        return theirs if mine_eta is None else min(mine_eta, theirs)

    def poll_every(self) -> float:
        """The interval between round-view reads: a share of the ETA; once the round is full and
        this peer computes ahead (delayed updates), a share of what is left of the last
        reduction's length, so the reads close in on the moment the next state is due (its
        carried samples go into the next round the sooner), poll_min_s for as long again past
        it, and then a share of the wait so far: a reduction held up costs a few stale samples,
        and few reads. Once it has computed ``AHEAD`` targets ahead it waits idle, and reads at a
        share of what is left (poll_min_s once that has passed): a long wait (the scheduler
        away) must not make it notice the next states late."""
        if self.poll_s is not None:
            return self.poll_s
        cadence, f = self.run.config.cadence, self.follower
        if f.behind:
            return cadence.poll_min_s
        waited = f.waited()
        if self.delayed and waited is not None:
            # idle (``AHEAD`` targets computed ahead), or the state due about now: read soon
            if self.activity == "waiting" or f.reduce_left() > 0 or f.expected():
                return cadence.poll_s(f.reduce_left())
            return cadence.poll_s(waited)
        return cadence.poll_s(self.eta())

    def heartbeat_every(self) -> float:
        """The keep-alive after a heartbeat: a share of the last round's length (before one
        passed here, of the ETA)."""
        if self.poll_s is not None:
            return min(3 * self.poll_s, self.run.config.peer_timeout_s / 3)
        f = self.follower
        return self.run.config.cadence.heartbeat_s(f.round_s if f.round_s is not None else self.eta())

    # work
    def step(self) -> bool:
        """One decision, and one micro-batch if there is work. False while only waiting."""
        if self.state is None:
            self.sync()
        self._settle()
        self.view()
        r, target = self.state, self.run.config.target_batch_size
        v = self._round()
        # full: closed, filled, a newer state on its way, or this peer capped (a further part would not count)
        full = v.closed or v.manifest_samples >= target or v.capped or self.transfers.fetching is not None
        acc = self.acc
        if v.ended is not None and not v.closed:  # nobody will aggregate round r: computing for it is lost
            self._report(waiting=True)
            self.activity = "waiting"
            return False
        if not full and acc is not None and acc.round == r + 1:
            acc.back(r)
        if full and acc is not None and acc.round == r and not acc.carry(self.delayed):
            self._upload(acc)  # may still make it before CLOSE; late otherwise
        ahead = full and acc is not None and acc.round == r + 1 and acc.samples >= AHEAD * target
        if full and (not self.delayed or ahead):  # enough stale samples: a shard may claim at
            self._report(waiting=True)  # most a few rounds' worth (validation.max_claim)
            self.activity = "waiting"
            return False
        self.activity = "computing"
        self._compute(r + 1 if full else r)
        acc = self.acc
        self._report()
        sending = any(x.round == r for x in self.transfers.sending)  # a second part waits for the first to land
        first = r not in self.parts.uploaded
        # the others, projected to now: they computed too while this micro-batch ran
        wanted = acc.round == r and not sending and self._wants(acc, first)
        if not wanted:
            self.parts.not_short()
        elif self.parts.still_short(r, self.transfers.upload_s) and (first or self._still_wanted(acc)):
            self._upload(acc)
        return True

    def _still_wanted(self, acc: Accumulator) -> bool:
        """A second part is sent on a view read just now: the view in hand may be older than the
        others' parts that filled the round meanwhile and its CLOSE (a part sent after it is lost;
        held, it is carried to the next round). One GET, only when a second part looks needed."""
        v = self.follower.read(self._mine)  # None without a fresh view: its own samples decide, as before
        return not (v is not None and v.closed) and self.transfers.fetching is None and self._wants(acc, first=False)

    def _wants(self, acc: Accumulator, first: bool) -> bool:
        """The upload rule (``upload_policy.should_upload``) on round ``state`` as this peer sees it now."""
        return upload_policy.should_upload(self._round(), acc.samples, self.run.config.target_batch_size, first)

    def _compute(self, round_: int) -> None:
        n = self.micro_batch
        self.local.compute(round_, n, self.train, stale=round_ > self.state)
        self.computed_samples += n
        self._note_speed(n)
        self.local.inner_step_due(self.state)

    def train(self, cursor: int, n: int) -> float:
        """Forward and backward on samples ``cursor`` to ``cursor + n`` of this peer's stream,
        gradients summed into the model's; the summed loss. (The coordination benchmark
        replaces it with a timed sleep: everything else is the worker's own code.)"""
        batch = {k: v.to(self.device) for k, v in self.source.batch(self.peer, cursor, n).items()}
        loss = loss_sum(self.model, batch)
        loss.backward()
        return loss.item()  # waits for the device: the caller's timer covers the whole step

    def _upload(self, acc: Accumulator) -> None:
        """Send ``acc`` as a shard on the transfer thread; the model's gradients are zeroed for
        the next part. Until the manifest lands its samples count as this peer's pending
        (heartbeat) and unseen shards (round view), so nobody reads them as missing."""
        update = self.local.update(self.state)  # acc.round is self.state
        self.parts.sent(acc.round)
        data = shard.DataRef(stream=self.peer, ranges=[tuple(x) for x in acc.ranges])
        cfg = self.run.config
        claims = dict(inner_steps=acc.steps, precision=self.precision) if (
            cfg.algorithm == "diloco" and cfg.inner_state == "shard") else {}
        sent = self.transfers.upload(update, acc.round, acc.samples, acc.loss_sum / acc.samples, data,
                                     acc.stale_samples, self.follower.state_hash, **claims)
        f = self.follower
        if f.view is not None:  # the view in hand counts it until the next read does
            f.view = replace(f.view, manifest_samples=f.view.manifest_samples + sent.samples)
        self.local.drop(self.params)  # its samples stay pending (``sending``) until the manifest lands

    def _settle(self, wait: bool = False) -> None:
        """Account for the transfers that finished (all of them with ``wait``): uploads are
        logged and heartbeaten, a downloaded state is installed. A transfer that failed after
        its retries raises here, on the worker's thread."""
        for sent in list(self.transfers.sending):
            if not (wait or sent.job.done()):
                continue
            activity, self.activity = self.activity, "uploading" if not sent.job.done() else self.activity
            try:
                key = sent.job.result()
            finally:
                self.activity = activity
            self.transfers.settled(sent, key)
            self.uploads.append((sent.round, key, sent.samples))
            self.uploaded_samples += sent.samples
            log.info("%s: uploaded %d samples to round %d (%s)", self.peer, sent.samples, sent.round, key)
            self.follower.looked = float("-inf")  # the next step reads the view again, this shard counted in
        self.follower.take_fetched(wait)

    def flush(self) -> None:
        """Wait for every transfer under way and account for it (lock-step drivers, leaving)."""
        self._settle(wait=True)

    def _report(self, waiting: bool = False, round_: int | None = None, left: bool = False) -> None:
        """Heartbeat for the round being accumulated (``round_``), when one is due
        (``heartbeat.due``; always with ``left``): its pending samples and speed, 0 while
        ``waiting``. Once the open round is full (closed, or its manifests reach the target) its
        count no longer matters, only the keep-alive; moving on to the next round while this one
        is short of its target, it first says it stopped computing this one, whose projection
        would go on growing."""
        now, acc, target = self.clock.time(), self.acc, self.run.config.target_batch_size
        r = round_ if round_ is not None else (acc.round if acc is not None else self.state)
        last = self._beats[-1] if self._beats else None
        v = self._round()
        full = v.closed or v.manifest_samples >= target or self.transfers.fetching is not None  # round ``state``'s
        pending = (acc.samples if acc and acc.round == r else 0) + self.transfers.on_the_way(r)
        counts = not (full and r == self.state)
        stopped = counts and waiting and last is not None and last.round == r and last.samples_per_s > 0
        if not (left or stopped or heartbeat.due(last, r, pending, self.transfers.landed(r), now, target,
                                                 self.micro_batch, counts)):
            return
        if not (left or full) and last is not None and last.round == self.state != r and last.samples_per_s > 0:
            self._beat(last.round, self.transfers.on_the_way(last.round), 0.0, now)
        self._beat(r, pending, 0.0 if waiting or left else self._speed, now, left)

    def _beat(self, r: int, pending: int, speed: float, now: float, left: bool = False) -> None:
        io = self.run.bucket.stats
        beat = Heartbeat(peer=self.peer, round=r, samples=pending, sending=self.transfers.on_the_way(r),
                         samples_per_s=speed, next_s=self.heartbeat_every(), time=now,
                         uploaded_samples=self.uploaded_samples, compute_s=self.compute_s,
                         wall_s=self.clock.monotonic() - self.started, bytes_up=io.bytes_written,
                         bytes_down=io.bytes_read, left=left, landed=self.transfers.landed(r),
                         upload_s=self.transfers.upload_s, held=tuple(self.follower.held))
        self._beats.append(beat)
        heartbeat.write(self.run.bucket, self.run.keys, beat)

    def _note_speed(self, n: int) -> None:
        """This peer's speed, for the ETA and its heartbeats: samples per second of wall time,
        uploads and a state's install included, smoothed over about ten micro-batches. While a
        round fills it computes a little faster than that, so the others' projections of its
        count stay just under it: they send a little late (a larger batch), never early (a
        second part, a round held up)."""
        now = self.clock.monotonic()
        if self._computed_at is not None:
            rate = n / max(1e-6, now - self._computed_at)
            self._speed = rate if self._speed == 0 else 0.9 * self._speed + 0.1 * rate
        self._computed_at = now

    def snapshot(self) -> Progress:
        """What this volunteer is doing; safe to call from a display's thread."""
        acc, io = self.acc, self.run.bucket.stats
        return Progress(peer=self.peer, state=self.state, activity=self.activity,
                        round=acc.round if acc is not None else self.state,
                        pending=acc.samples if acc is not None else 0, computed=self.computed_samples,
                        uploaded=self.uploaded_samples, uploads=tuple(self.uploads),
                        target=self.run.config.target_batch_size, view=self.follower.view,
                        bytes_up=io.bytes_written, bytes_down=io.bytes_read,
                        scheduler=self.follower.scheduler_note() if self.state is not None else None,
                        fetching=self.transfers.fetching[0] if self.transfers.fetching is not None else None,
                        view_age_s=None if self.follower.view is None or self.follower.read_at is None
                        else self.clock.monotonic() - self.follower.read_at)

    def leave(self) -> None:
        """Finish the uploads under way, then tell the others this peer's pending samples will
        not come."""
        try:
            self.flush()
        except BaseException:  # a second Ctrl-C: the upload under way ends before its manifest
            self.transfers.abandon()
            raise
        finally:
            self.transfers.close()
            if self.state is not None:
                self.local.drop(self.params)
                # the open round's, and the next one's if it heartbeated there (computing ahead):
                # a live heartbeat of either keeps the id taken (joining.check_not_live)
                for r in sorted({self.state} | {b.round for b in self._beats if b.round > self.state}):
                    self._report(round_=r, left=True)

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
