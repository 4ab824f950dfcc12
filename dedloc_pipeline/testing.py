"""Deterministic collaborations in one process: a fake clock, a small run config, a lock-step driver.

Used by the tests and the benchmarks alike. A ``FakeClock`` moves only when advanced (or slept on),
so a timing case (a peer's heartbeat going stale, a killed worker, a late joiner, a close
timeout) is a sequence of steps with exact assertions, not real processes and real sleeps.
"""

from __future__ import annotations

import re
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from .organizer.scheduler import Scheduler
from .protocol import shard
from .protocol.clock import Clock
from .protocol.config import CloseRule, OptimizerConfig, RunConfig
from .protocol.run import Run
from .volunteer.aggregator import AggregatorRole
from .volunteer.worker import Worker

# The micro preset (~0.3M parameters) in chunks of 10 blocks: quick on 2 cores, and cut as tiny is
# in chunks of 2^18 (8 chunks, 3 aggregator parts, one straddling tensors). Benchmarks take TINY.
SMALL = dict(preset="micro", seq_len=32, chunk_size=10 * 4096, block_size=4096, chunks_per_part=3)
TINY = dict(preset="tiny", chunk_size=1 << 18)


def small_config(run: str = "test", **kw) -> RunConfig:
    """A tiny run: target 24 samples in micro-batches of 4, exact codec, no delayed updates."""
    opt = kw.pop("optimizer", {})
    close = kw.pop("close", {})
    base = dict(SMALL, run=run, target_batch_size=24, micro_batch=4, codec="none",
                delayed_updates=False, peer_timeout_s=30.0)
    base.update(kw)
    return RunConfig(**base, optimizer=OptimizerConfig(**opt), close=CloseRule(**close))


class FakeClock(Clock):
    """A clock that moves only when ``advance`` (or ``sleep``) is called; threads may read it."""

    def __init__(self, epoch: float = 1_800_000_000.0) -> None:
        self._epoch, self._now, self._lock = epoch, 0.0, threading.Lock()

    def time(self) -> float:
        return self._epoch + self._now

    def monotonic(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += max(0.0, seconds)


class DrivenClock(FakeClock):
    """A FakeClock whose ``sleep`` first lets the test's other parties act (``parties``: each
    called once a sleep, never from inside one): what a process waiting on the bucket would see
    the others do meanwhile (volunteer aggregators, while the scheduler waits for their answers)."""

    def __init__(self, epoch: float = 1_800_000_000.0) -> None:
        super().__init__(epoch)
        self.parties: list[Callable[[], None]] = []
        self._inside = False

    def sleep(self, seconds: float) -> None:
        if not self._inside:
            self._inside = True
            try:
                for party in list(self.parties):
                    party()
            finally:
                self._inside = False
        self.advance(seconds)


def on_clock(run: Run, clock: Clock | None = None) -> Run:
    """``run`` read through ``clock`` (default: a FakeClock starting at state 0's COMMIT, so a
    round opened by ``init_run`` is no older than the clock says), with its organizer key."""
    clock = clock or FakeClock(epoch=run.commit_of(0)["committed_at"])
    return Run(run.bucket, run.name, run.config, organizer=run._organizer, clock=clock)


class LockStep:
    """A collaboration stepped by hand in one process. ``tick`` steps every worker once (its
    transfers landing before the next one moves: deterministic), the scheduler (if any) on every
    ``scheduler_every``-th tick, then moves the run's clock ``step_s`` seconds (a FakeClock's: so
    every micro-batch takes ``step_s``, and speeds, heartbeat ages and timeouts are exact). A
    worker ``kill``-ed is no longer stepped: it stops heartbeating and uploading, as a SIGKILL
    would; the ``scheduler`` set to None has died. ``poll_s`` is the workers' fixed cadence (0:
    they read the view and heartbeat every step, and send a second part at once; a timing case
    wants it above 0)."""

    def __init__(self, run: Run, poll_s: float = 0, step_s: float = 0.0, scheduler: bool = True,
                 scheduler_every: int = 2, delayed: bool | None = None, volunteers: bool = False):
        self.run, self.poll_s, self.step_s, self.delayed = run, poll_s, step_s, delayed
        self.scheduler_every, self.ticks = scheduler_every, 0
        self.scheduler = Scheduler(run, parallel=2, poll_s=poll_s, volunteers=volunteers) if scheduler else None
        self.workers: dict[str, Worker] = {}
        self.aggregators: dict[str, AggregatorRole] = {}
        self._pool = ThreadPoolExecutor(2)

    def __enter__(self) -> "LockStep":
        return self

    def __exit__(self, *exc) -> None:
        """The workers still stepped leave, as a Ctrl-C ends them (a killed one never does), so a
        later collaboration may start the same peer ids at once."""
        try:
            for w in self.workers.values():
                w.leave()
        finally:
            self._pool.shutdown()

    def join(self, peer: str, micro_batch: int, signer=None, tamper: Callable | None = None) -> Worker:
        """A volunteer that is stepped from the next tick on. ``tamper``: what it does to its
        gradient, or in the local-steps mode its pseudo-gradient, before uploading (a byzantine peer)."""
        w = Worker(self.run, peer, micro_batch=micro_batch, threads=1, delayed=self.delayed, poll_s=self.poll_s,
                   signer=signer)
        if tamper is not None and w.local.inner is not None:
            pseudo = w.local.update
            w.local.update = lambda state: tamper(pseudo(state))
        elif tamper is not None:
            honest = w.flat.grad
            w.flat.grad = lambda: tamper(honest())
        self.workers[peer] = w
        return w

    def aggregate(self, peer: str, signer) -> AggregatorRole:
        """A volunteer aggregator, stepped each tick, and at each sleep of a DrivenClock (the
        run's), so it answers while the scheduler waits for it."""
        role = self.aggregators[peer] = AggregatorRole(self.run, peer, signer)
        if isinstance(self.run.clock, DrivenClock):
            self.run.clock.parties.append(lambda: peer in self.aggregators and self.aggregators[peer].step())
        return role

    def kill(self, peer: str) -> Worker:
        """Stop stepping ``peer``: no leave, no last heartbeat."""
        return self.workers.pop(peer)

    def tick(self) -> None:
        for w in list(self.workers.values()):
            w.step()
            w.flush()
        for a in list(self.aggregators.values()):
            a.step()
        if self.scheduler is not None and self.ticks % self.scheduler_every == 0:
            self.scheduler.step(self._pool)
        self.ticks += 1
        if self.step_s:
            self.run.clock.sleep(self.step_s)

    def until(self, done: Callable[[], object], max_ticks: int = 2000, what: str = "the condition"):
        """Tick until ``done()`` is truthy (checked before each tick); its value."""
        for _ in range(max_ticks):
            if got := done():
                return got
            self.tick()
        raise AssertionError(f"{what} not reached in {max_ticks} ticks (state {self.run.latest()})")


def collaborate(run, peers: list[tuple[str, int]], rounds: int, delayed: bool | None = None,
                max_steps: int = 2000, scheduler_every: int = 2, signers: dict | None = None,
                tamper: dict | None = None) -> list[Worker]:
    """Every worker takes one step, and every few such steps the scheduler one (so workers see
    full rounds that are not yet committed), until state ``rounds`` is committed. ``tamper``
    maps a peer to what it does to its gradient before uploading (a byzantine peer)."""
    signers, tamper = signers or {}, tamper or {}
    with LockStep(run, scheduler_every=scheduler_every, delayed=delayed) as c:
        workers = [c.join(name, mb, signer=signers.get(name), tamper=tamper.get(name)) for name, mb in peers]
        c.until(lambda: run.latest() >= rounds, max_steps, f"state {rounds}")
    return workers


def run_processes(commands: list[list[str]], logs: Path, env: dict, timeout_s: float) -> str:
    """Start every command at once (stdout and stderr to ``logs``/``i``.log), wait for them all,
    kill what is left after ``timeout_s``; AssertionError with the logs' tails unless every one
    exited 0, else those tails (a multi-process test's evidence)."""
    files = [open(logs / f"{i}.log", "w") for i in range(len(commands))]
    procs = [subprocess.Popen(c, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
             for c, f in zip(commands, files)]
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    tails = "\n".join((logs / f"{i}.log").read_text()[-1500:] for i in range(len(commands)))
    assert [p.returncode for p in procs] == [0] * len(procs), tails
    return tails


def assert_counted_once(run: Run) -> None:
    """No sample of any stream counts in two accepted shards, over every committed round."""
    seen: set[tuple[str, int]] = set()
    for r in range(run.latest()):
        for s in run.bucket.read_json(run.keys.close(r))["accepted"]:
            got = {(s["data"]["stream"], i) for a, n in s["data"]["ranges"] for i in range(a, a + n)}
            assert not got & seen, f"round {r}: {s['key']} counts samples already counted"
            seen |= got


def written(run, r, kind="manifest"):
    """Every peer's keys of round r of one ``kind`` (``RunLayout.of_round``), as the bucket holds them now."""
    return run.keys.of_round(run.bucket.find(run.keys.volunteers_dir), r, kind)


def stream_next(run, r, peer):
    """Where an honest ``peer``'s next shard of round r starts: after its counted samples and
    its other parts of the round."""
    ends = [int(run.stream_ends(r).get(peer, 0))]
    for raw in run.bucket.read_many(run.bucket.find(run.keys.manifests_dir(r, peer))).values():
        ends.append(shard.Manifest.model_validate_json(raw).data.end())
    return max(ends)


# moto's request log, a line per request it answered: [01/Dec/2026 11:22:40] "GET /bkt/p/k?x HTTP/1.1" 200 -
_MOTO_LINE = re.compile(r'\[(\d\d/\w\w\w/\d{4} \d\d:\d\d:\d\d)\] "(\w+) ([^ ?"]*)(\?[^ "]*)? HTTP')


@dataclass(frozen=True)
class Logged:
    """One request as moto's server logged it."""

    at: float  # the second it was answered in (the log has whole seconds)
    method: str
    path: str
    query: str  # with its leading "?", or ""
    kind: str  # as the Bucket counts it (IOStats): get, put, head, list or delete


def request_kind(method: str, query: str) -> str:
    """The Bucket's request kind of an S3 request: a GET with ``list-type`` (or a v1 ``prefix``
    listing) is a LIST, a POST ``?delete`` a multi-object DELETE."""
    if method == "GET":
        return "list" if "list-type=" in query or query.startswith("?prefix") else "get"
    if method == "POST" and "delete" in query:
        return "delete"
    return method.lower()


def moto_log(path: str | Path) -> list[Logged]:
    """Every request in moto's log at ``path``, in the order answered (the server's own count,
    against which the Bucket's counters are checked and benchmark 7 measures)."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for m in map(_MOTO_LINE.search, f):
            if m:
                at = datetime.strptime(m.group(1), "%d/%b/%Y %H:%M:%S").timestamp()
                query = m.group(4) or ""
                out.append(Logged(at, m.group(2), m.group(3), query, request_kind(m.group(2), query)))
    return out
