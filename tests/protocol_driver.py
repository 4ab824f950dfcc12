"""Run workers and a scheduler in one process, in lock-step: deterministic collaborations."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from dedloc_pipeline.protocol import shard
from dedloc_pipeline.protocol.scheduler import Scheduler
from dedloc_pipeline.protocol.worker import Worker


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
