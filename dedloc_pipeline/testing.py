"""Deterministic collaborations in one process: a fake clock, a small run config, a lock-step driver.

Used by the tests and the benchmarks alike. A ``FakeClock`` moves only when advanced (or slept on),
so a timing case (a peer's heartbeat going stale, a killed worker, a late joiner, a close
timeout) is a sequence of steps with exact assertions, not real processes and real sleeps.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from .protocol import shard
from .protocol.clock import Clock
from .protocol.config import CloseRule, OptimizerConfig, RunConfig
from .protocol.scheduler import Scheduler
from .protocol.worker import Worker

# Small enough to be quick on 2 cores, big enough to cut the ~1.9M-parameter vector into
# several chunks and several aggregator parts (one part straddles tensors).
SMALL = dict(seq_len=32, chunk_size=1 << 18, block_size=4096, chunks_per_part=3)


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


def collaborate(run, peers: list[tuple[str, int]], rounds: int, delayed: bool | None = None,
                max_steps: int = 2000, scheduler_every: int = 2, signers: dict | None = None,
                tamper: dict | None = None) -> list[Worker]:
    """Every worker takes one step, and every few such steps the scheduler one (so workers see
    full rounds that are not yet committed), until state ``rounds`` is committed. ``tamper``
    maps a peer to what it does to its gradient before uploading (a byzantine peer)."""
    signers = signers or {}
    workers = [Worker(run, name, micro_batch=mb, threads=1, delayed=delayed, poll_s=0, signer=signers.get(name))
               for name, mb in peers]
    for w in workers:
        if w.peer in (tamper or {}):
            honest, attack = w.flat.grad, tamper[w.peer]
            w.flat.grad = lambda honest=honest, attack=attack: attack(honest())
    sched = Scheduler(run, parallel=2, poll_s=0)
    with ThreadPoolExecutor(2) as pool:
        for i in range(max_steps):
            if run.latest() >= rounds:
                return workers
            for w in workers:
                w.step()
                w.flush()  # its transfers land before anyone's next move: deterministic
            if i % scheduler_every == 0:
                sched.step(pool)
    raise AssertionError(f"state {rounds} not reached in {max_steps} steps")


def stream_next(run, r, peer):
    """Where an honest ``peer``'s next shard of round r starts: after its counted samples and
    its other parts of the round."""
    ends = [int(run.stream_ends(r).get(peer, 0))]
    for raw in run.bucket.read_many(run.bucket.find(run.keys.manifests_dir(r, peer))).values():
        ends.append(shard.Manifest.model_validate_json(raw).data.end())
    return max(ends)
