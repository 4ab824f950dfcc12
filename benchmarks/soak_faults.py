"""The soak with faults (docs/soak.md, "With faults"): a few hundred rounds on the fake clock with
volunteers arriving and departing at random, the scheduler and the aggregators SIGKILLed inside a
round's steps and started again, the disk full and the bucket failing for stretches. Nothing may
be lost or counted twice, every round must close while someone live can fill it, and every
committed state must equal a one-process replay of the committed rounds.

Every role is a process of its own: its own Run over its own Bucket (``dedloc_pipeline.faults``:
the faults all processes share, and its own kill switch), on one FakeClock, in lock-step. Each
tick the live workers take a step, the scheduler one, then the clock moves ``STEP_S``. A round is
aggregated as ``dedloc aggregate`` does it (``Scheduler.step``: parts on the scheduler's threads,
an "engine" round) or as the Prefect round flow does (a "flow" round: try_close, each
part on an aggregator process of its own, tried again as Prefect retries a task, commit). Drawn
from generators seeded by the seed and the tick (churn), the round (its kill) or nothing else (the
bucket's stretches, counted in ticks), and, for which requests fail, from each request itself
(its process, what it is, how many times that process made it: ``Faults``), so that the order in
which the threads' requests arrive, which the machine's load decides, moves none of it; only
where among a process's threads a kill falls (a real SIGKILL's lot), and what the others had
done, is left to the threads:

- volunteers arrive (a new id, or one that departed) and depart: Ctrl-C (``leave``) or vanishing
  (killed at a request of its next step, mid-upload perhaps); a worker that fails (the bucket
  down past its retries) exits, and systemd starts it again ``RESTART_S`` later;
- a scheduler is killed at a random request of an engine round, or inside a chosen step of a flow
  round (try_close, an aggregator's reduce or apply part, commit); one that fails exits
  alike; it is started again a few ticks later, in one place (``Soak.new_scheduler``);
- the bucket fails a share of requests, before or after they take effect, for stretches of
  ticks, and the disk is full (ENOSPC on every write) for shorter ones.
"""

from __future__ import annotations

import logging
import math
import random
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dedloc_pipeline.compute import aggregation
from dedloc_pipeline.faults import Faults, Kill, Killed, Stretches, inject
from dedloc_pipeline.organizer import ledger
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run, RunError, init_run
from dedloc_pipeline.storage.bucket import Bucket, StorageError
from dedloc_pipeline.storage.retry import RetryPolicy
from dedloc_pipeline.testing import on_clock
from dedloc_pipeline.volunteer.worker import Worker

from . import soak_verdict

STEP_S = 1.0  # fake seconds a tick: one micro-batch of every live worker
POLL_S = 1.0  # the workers' cadence: a view read every second, a heartbeat every three
RESTART_S = 30.0  # systemd's RestartSec for a worker that failed (docs/volunteer.md)
HOLDER = "soak-scheduler"  # every scheduler here: a restarted one takes over its own lease at once
ARRIVE = {0: 0.15, 1: 0.06, 2: 0.04, 3: 0.02, 4: 0.0}  # chance a tick, by the volunteers live
DEPART = {0: 0.0, 1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04}
MICRO_BATCHES = (3, 4, 6)
FLOW_SHARE, KILL_ENGINE, KILL_FLOW = 0.5, 0.3, 0.5  # per round: flow rounds; rounds with a kill
SCHEDULER_BACK_S = (0.0, 1.0, 2.0, 5.0)  # how soon a dead scheduler is started again
AGGREGATORS, ATTEMPTS = 2, 4  # aggregator processes; a part's tries (Prefect: retries=3)
RETRY = RetryPolicy(attempts=6, wait_s=0.0, max_wait_s=0.0)  # the default attempts, no real waits
FLOW_PHASES = ("try_close", "reduce_part", "apply_part", "commit")
# where a kill or a failure happened: the innermost of these frames (module.function) in its traceback
FRAMES = {"scheduler.try_close": "try_close", "scheduler._publish": "view",
          "aggregation.reduce_part": "reduce_part", "aggregation.apply_part": "apply_part",
          "ledger._write_commit": "commit", "ledger.prune": "prune", "lease.hold": "lease",
          "transfers._send": "upload", "follower.load": "download", "worker._report": "heartbeat",
          "follower.read": "view", "run.latest": "poll"}
EXPECTED = (StorageError,)  # what a process may fail with here: the bucket down past its retries


def stall_bound(cfg) -> float:
    """The longest a round may stay open (no CLOSE) while a volunteer is live: those who vanished
    still count as present, capping the others, until their last heartbeat (every 3 polls) is
    ``peer_timeout_s`` old; then the slowest volunteer alone fills the target; and a scheduler
    killed on the way is back within the longest restart. Fill and restart twice: a second kill
    or failure in the same round."""
    fill = cfg.target_batch_size / min(MICRO_BATCHES) * STEP_S
    return cfg.peer_timeout_s + 3 * POLL_S + 2 * (fill + max(SCHEDULER_BACK_S))


class PartFailed(RuntimeError):
    """A part failed on every try: the round flow fails, and the pretrain flow starts again."""


def phase_of(exc: BaseException) -> str:
    names = [f"{Path(f.filename).stem}.{f.name}" for f in traceback.extract_tb(exc.__traceback__)]
    return next((FRAMES[n] for n in reversed(names) if n in FRAMES), "other")


@dataclass
class Plan:
    """A round's kill: in ``phase`` (flow rounds; "any" in engine rounds), at the request ``at`` of
    the way through what that phase took last time."""

    phase: str
    at: float
    part: int = 0
    fired: bool = False


class Soak:
    def __init__(self, cfg, url: str, seed: int, log=print):
        self.cfg, self.url, self.log, self.seed = cfg, url, log, seed
        self.auditor = on_clock(init_run(Bucket(url), cfg))  # reads the bucket as it is: no faults
        self.clock, self.keys = self.auditor.clock, self.auditor.keys
        self.faults = Faults(0.0, seed=seed, epoch=self.clock.time())  # part names counted from the start
        self.stretches = Stretches(self.faults, random.Random(f"{seed}/weather"))
        self.replay = soak_verdict.Replay(self.auditor)
        self.live: dict[str, tuple[Worker, Kill, bool]] = {}  # peer -> worker, kill switch, vanishing
        self.gone: dict[str, float] = {}  # departed peer -> when its id may start again
        self.restarting: dict[str, float] = {}  # failed peer -> when systemd starts it again
        self.sched, self.sched_at = None, 0.0
        self.aggs: list[tuple[Run, Kill] | None] = [None] * AGGREGATORS
        self.plans: dict[int, Plan | None] = {}
        self.modes: dict[int, str] = {}
        self.requests = {"any": 400, **{p: 20 for p in FLOW_PHASES}}  # last measured, to draw kills in
        self.state, self.next_id, self.ticks = 0, 0, 0
        self.open_s: Counter[int] = Counter()  # round -> seconds open (no CLOSE) with someone live
        self.wait_s: Counter[int] = Counter()  # round -> seconds before its COMMIT with someone live
        self.live_s: Counter[int] = Counter()  # volunteers live -> seconds
        self.events: list[dict] = []
        self.unexpected: list[dict] = []  # failures that are not the bucket's: bugs

    # processes
    def process(self, name: str) -> tuple[Run, Kill]:
        kill = Kill(name)
        return Run(inject(Bucket(self.url), self.faults, kill, RETRY), self.cfg.run, clock=self.clock), kill

    def new_scheduler(self):
        """The one place schedulers start (the first, and every restart): the same holder, so a
        restart takes over the lease its killed predecessor left at once."""
        run, kill = self.process("scheduler")
        return Scheduler(run, parallel=2, poll_s=POLL_S, holder=HOLDER), kill, ThreadPoolExecutor(2)

    def event(self, kind: str, who: str, exc: BaseException | None = None, **kw) -> None:
        ev = {"tick": self.ticks, "state": self.state, "event": kind, "who": who, **kw}
        if exc is not None:
            ev.update(phase=phase_of(exc), error=f"{type(exc).__name__}: {str(exc)[:200]}")
            if not isinstance(exc, (Killed, PartFailed, *EXPECTED)):
                self.unexpected.append(dict(ev, traceback=traceback.format_exception(exc)[-6:]))
        self.events.append(ev)

    # volunteers
    def start(self, peer: str, kind: str) -> None:
        try:
            run, kill = self.process(peer)
            w = Worker(run, peer, micro_batch=self.rng.choice(MICRO_BATCHES), threads=1, poll_s=POLL_S)
        except RunError as exc:  # refused as live, its id free by now: unexpected (``event``)
            self.event("refused", peer, exc, as_=kind)
            return
        except Exception as exc:
            self.event("start_failed", peer, exc, as_=kind)
            if kind == "restart":
                self.restarting[peer] = self.clock.time() + RESTART_S
            return
        self.live[peer] = (w, kill, False)
        self.gone.pop(peer, None)
        self.event(kind, peer, micro_batch=w.micro_batch, resumes_at=w.cursor)

    def drop(self, peer: str, free_at: float | None) -> None:
        """``peer``'s process ends; its id may start again from ``free_at`` (None: systemd starts
        it again by itself)."""
        w, kill, _ = self.live.pop(peer)
        kill.now()  # nothing it does from here on reaches the bucket
        w.transfers.close()
        if free_at is not None:
            self.gone[peer] = free_at

    def churn(self) -> None:
        now, timeout = self.clock.time(), self.cfg.peer_timeout_s
        for peer, at in sorted(self.restarting.items()):
            if now >= at:
                del self.restarting[peer]
                self.start(peer, "restart")
        n = len(self.live)
        if self.rng.random() < ARRIVE[min(n, 4)]:
            back = sorted(p for p, at in self.gone.items() if now >= at)
            if back and self.rng.random() < 0.5:
                self.start(self.rng.choice(back), "return")
            else:
                self.next_id += 1
                self.start(f"p{self.next_id:03d}", "join")
        if not n or self.rng.random() >= DEPART[min(n, 4)]:
            return
        peer = self.rng.choice(sorted(self.live))
        w, kill, _ = self.live[peer]
        if self.rng.random() < 0.5:  # it dies at one of its next step's requests, perhaps mid-upload
            kill.arm(self.rng.randint(1, 12))
            self.live[peer] = (w, kill, True)
            return
        try:  # Ctrl-C: its uploads finish, and its last heartbeat says it left
            w.leave()
        except Exception as exc:  # the bucket failed it on the way out: its id frees as a silent one's
            self.drop(peer, now + timeout)
            self.event("leave_failed", peer, exc)
            return
        self.drop(peer, now)
        self.event("leave", peer)

    def step_workers(self) -> None:
        timeout = self.cfg.peer_timeout_s
        for peer in sorted(self.live):
            w, kill, vanishing = self.live[peer]
            try:
                w.step()
                w.flush()
            except Killed as exc:
                self.drop(peer, self.clock.time() + timeout)
                self.event("vanish", peer, exc)
                continue
            except Exception as exc:  # the process exits; systemd starts it again
                self.drop(peer, None)
                self.restarting[peer] = self.clock.time() + RESTART_S
                self.event("worker_failed", peer, exc)
                continue
            if vanishing:
                self.drop(peer, self.clock.time() + timeout)
                self.event("vanish", peer, phase="between steps")

    # the scheduler and the aggregators
    def plan(self, r: int) -> Plan | None:
        """Round r's aggregation (engine or flow) and kill, drawn once, from the seed and r alone."""
        if r not in self.plans:
            rng = random.Random(f"{self.seed}/round/{r}")
            self.modes[r] = "flow" if rng.random() < FLOW_SHARE else "engine"
            flow = self.modes[r] == "flow"
            phase = rng.choice(FLOW_PHASES) if flow else "any"
            kill = rng.random() < (KILL_FLOW if flow else KILL_ENGINE)
            self.plans[r] = Plan(phase, rng.random(), rng.randrange(self.auditor.n_parts)) if kill else None
        return self.plans[r]

    def arm(self, kill: Kill, plan: Plan) -> None:
        plan.fired = True
        kill.arm(math.ceil(plan.at * self.requests[plan.phase]))

    def step_scheduler(self) -> None:
        if self.sched is None:
            if self.clock.time() < self.sched_at:
                return
            try:
                self.sched = self.new_scheduler()
            except Exception as exc:
                self.event("scheduler_start_failed", "scheduler", exc)
                self.sched_at = self.clock.time() + STEP_S
                return
            self.event("scheduler_start", "scheduler")
        sched, kill, pool = self.sched
        r = self.state
        try:
            plan = self.plan(r)
            if self.modes[r] == "engine":
                self.engine(sched, kill, pool, r, plan)
            else:
                self.flow(sched, kill, r, plan)
        except (Killed, Exception) as exc:
            kill.now()
            pool.shutdown(wait=True)
            self.sched, self.sched_at = None, self.clock.time() + self.rng.choice(SCHEDULER_BACK_S)
            self.event("scheduler_killed" if isinstance(exc, Killed) else "scheduler_failed", "scheduler", exc,
                       mode=self.modes.get(r))

    def engine(self, sched: Scheduler, kill: Kill, pool, r: int, plan: Plan | None) -> None:
        """One ``Scheduler.step`` (as ``dedloc aggregate``), killed at a request of the round's if
        its plan says so: armed at its first step, disarmed once the round is committed."""
        if plan is not None and not plan.fired:
            self.arm(kill, plan)
        before = kill.requests
        if sched.step(pool):
            kill.disarm()
            if plan is None:
                self.requests["any"] = max(20, kill.requests - before)

    def phase(self, kill: Kill, plan: Plan | None, name: str, fn, part: int | None = None):
        """``fn()`` as step ``name`` of a flow round, killed there if the round's plan says so."""
        if plan is not None and plan.phase == name and not plan.fired and part in (None, plan.part):
            self.arm(kill, plan)
        before = kill.requests
        try:
            out = fn()
        finally:
            kill.disarm()
        if plan is None or plan.phase != name:
            self.requests[name] = max(5, kill.requests - before)
        return out

    def flow(self, sched: Scheduler, kill: Kill, r: int, plan: Plan | None) -> None:
        """The Prefect round flow's steps: try_close (a kill planned there is armed from the
        round's first poll on, until it closes), the parts on the aggregators, commit."""
        if plan is not None and plan.phase == "try_close" and not plan.fired:
            self.arm(kill, plan)
        before = kill.requests
        close = sched.try_close(r)
        if close is None:
            return
        kill.disarm()
        if plan is None or plan.phase != "try_close":
            self.requests["try_close"] = max(5, kill.requests - before)
        for fn in (aggregation.reduce_part, aggregation.apply_part):
            for k in range(self.auditor.n_parts):
                self.on_aggregator(fn, r, k, plan)
        self.phase(kill, plan, "commit", lambda: ledger.commit(sched.run, r))

    def on_aggregator(self, fn, r: int, k: int, plan: Plan | None) -> None:
        """Part k of round r on its aggregator; a killed one is replaced, a failed one tries again."""
        slot = k % AGGREGATORS
        for attempt in range(ATTEMPTS):
            try:
                if self.aggs[slot] is None:
                    self.aggs[slot] = self.process(f"aggregator-{slot}")
                run, kill = self.aggs[slot]
                return self.phase(kill, plan, fn.__name__, lambda: fn(run, r, k), part=k)
            except Killed as exc:
                self.aggs[slot] = None
                self.event("aggregator_killed", f"aggregator-{slot}", exc, part=k)
            except Exception as exc:
                self.event("aggregator_failed", f"aggregator-{slot}", exc, part=k, attempt=attempt)
        raise PartFailed(f"round {r}: part {k}'s {fn.__name__} failed {ATTEMPTS} times")

    # the run
    def observe(self) -> None:
        """After each tick: new states replayed (before pruning takes their shards), and the
        seconds the open round stayed open while someone live could fill it."""
        latest = self.auditor.latest()
        while self.state < latest:
            self.replay.next()
            self.state += 1
        self.live_s[len(self.live)] += STEP_S
        if self.live:
            self.wait_s[latest] += STEP_S
            if not self.auditor.bucket.exists(self.keys.close(latest)):
                self.open_s[latest] += STEP_S

    def tick(self) -> None:
        self.rng = random.Random(f"{self.seed}/tick/{self.ticks}")  # this tick's churn and restarts
        self.stretches.update()
        self.churn()
        self.step_workers()
        self.step_scheduler()
        self.observe()
        self.ticks += 1
        self.clock.advance(STEP_S)

    def run(self, rounds: int, max_round_s: float) -> str | None:
        """Tick until state ``rounds``; the reason it stopped short (a round open past
        ``max_round_s`` with someone live), or None."""
        every = max(1, rounds // 10)
        while self.state < rounds:
            at = self.state
            self.tick()
            if self.wait_s[self.state] > max_round_s:
                return f"round {self.state} not committed in {max_round_s:.0f} s with volunteers live"
            if self.state > at and self.state % every == 0 and self.log:
                self.log(f"state {self.state}/{rounds}: tick {self.ticks}, {len(self.live)} live, "
                         f"{sum(e['event'] == 'scheduler_killed' for e in self.events)} scheduler kills, "
                         f"faults {dict(self.faults.injected)}")
        return None

    def close(self) -> None:
        for peer in sorted(self.live):
            w, kill, _ = self.live[peer]
            try:
                w.leave()
            except Exception as exc:
                self.event("leave_failed", peer, exc)
            self.drop(peer, self.clock.time())
        if self.sched is not None:
            self.sched[2].shutdown(wait=True)


def soak(cfg, rounds: int, url: str, seed: int = 0, log=print) -> dict:
    """Run ``rounds`` rounds of ``cfg`` in the bucket at ``url`` with faults; the facts and the
    verdict (benchmarks/soak_verdict.py)."""
    import time

    import torch

    torch.set_num_threads(1)
    # each retry is logged as a warning: thousands here, counted in the facts instead
    logging.getLogger("dedloc_pipeline.storage.retry").setLevel(logging.ERROR)
    t0 = time.monotonic()
    s = Soak(cfg, url, seed, log)
    try:
        stalled = s.run(rounds, max_round_s=4 * stall_bound(cfg))
    finally:
        s.close()
    facts = {"rounds": rounds, "reached": s.state, "stalled": stalled, "ticks": s.ticks, "seed": seed,
             "fake_s": s.ticks * STEP_S, "wall_s": round(time.monotonic() - t0, 1),
             "events": s.events, "unexpected": s.unexpected, "modes": Counter(s.modes.values()),
             "faults_injected": dict(s.faults.injected), "requests": s.faults.requests,
             "stretches": dict(s.stretches.counts), "open_s": dict(s.open_s), "wait_s": dict(s.wait_s),
             "peer_ids": s.next_id, "live_s": dict(s.live_s), "stall_bound_s": stall_bound(cfg)}
    return soak_verdict.faults_verdict(s.auditor, s.replay, facts)
