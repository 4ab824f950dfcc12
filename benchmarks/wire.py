"""Benchmark 2: bytes on the wire per parameter per peer per round, and what each codec costs in loss.

Four peers and a scheduler collaborate in one process, in lock-step, so every codec sees the same
samples in the same order and their loss curves are comparable round by round. Each peer opens the
bucket on its own, so its IOStats count exactly its own requests: up is every byte it wrote
(shards, manifests, heartbeats), down every byte it read (parameter deltas, COMMITs, the other
peers' manifests and heartbeats). Rounds after the warm-up are counted.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# (gradient codec, parameter-delta codec); None is the run's default for that codec
CASES = [("none", None), ("fp16", None), ("int8", "int8"), ("int8", None), ("int4", None)]


def _lockstep(url: str, name: str, peers: int, rounds: int, warmup: int):
    """Each peer one micro-batch, the scheduler one step every other turn, until ``rounds``."""
    from dedloc_pipeline.organizer.scheduler import Scheduler
    from dedloc_pipeline.protocol.run import Run
    from dedloc_pipeline.storage.bucket import Bucket
    from dedloc_pipeline.volunteer.worker import Worker

    def opened() -> Run:
        return Run(Bucket(url), name)

    workers = [Worker(opened(), f"peer-{i}", threads=1, poll_s=0) for i in range(peers)]
    sched, run = Scheduler(opened(), poll_s=0), opened()
    marks = {}
    with ThreadPoolExecutor(2) as pool:
        turn = 0
        while run.latest() < rounds:
            if run.latest() == warmup and not marks:
                marks = {w.peer: w.run.bucket.stats.snapshot() for w in workers}
            for w in workers:
                w.step()
                w.flush()  # its transfers land before anyone's next move: deterministic
            if turn % 2 == 0:
                sched.step(pool)
            turn += 1
    return run, workers, marks


def measure(codec: str, download: str | None, peers: int = 4, micro_batch: int = 8, target: int = 64,
            seq_len: int = 64, rounds: int = 12, warmup: int = 2) -> dict:
    from dedloc_pipeline.protocol.config import recipe_config
    from dedloc_pipeline.protocol.run import init_run
    from dedloc_pipeline.storage.bucket import Bucket

    url = f"file://{tempfile.mkdtemp(prefix='dedloc-wire-')}"
    name = f"wire-{codec}-{download}"
    cfg = recipe_config(name, "tiny", codec=codec, download_codec=download, target_batch_size=target,
                        micro_batch=micro_batch, seq_len=seq_len)
    init_run(Bucket(url), cfg)
    run, workers, marks = _lockstep(url, name, peers, rounds, warmup)
    n, counted = run.flat.n, rounds - warmup
    up, down = [], []
    for w in workers:
        now, then = w.run.bucket.stats.snapshot(), marks[w.peer]
        up.append((now["bytes_written"] - then["bytes_written"]) / n / counted)
        down.append((now["bytes_read"] - then["bytes_read"]) / n / counted)
    return {"codec": codec, "download_codec": cfg.param_codec, "n_params": n, "rounds": counted,
            "up_bytes_per_param": float(np.mean(up)), "down_bytes_per_param": float(np.mean(down)),
            "loss": [run.commit_of(r)["loss"] for r in range(1, rounds + 1)]}


def run(rounds: int = 12) -> dict:
    cases = [measure(c, d, rounds=rounds) for c, d in CASES]
    exact = np.array(cases[0]["loss"])
    for case in cases:
        dev = np.abs(np.array(case["loss"]) - exact) / exact
        case["loss_max_rel_dev"] = float(dev.max())
        case["total_bytes_per_param"] = case["up_bytes_per_param"] + case["down_bytes_per_param"]
    return {"what": "bytes per parameter per peer per round, counted by each peer's bucket (4 peers, "
                    "tiny, micro-batch 8, target 64, seq 64); loss deviation from codec none at equal rounds",
            "cases": cases}


def table(res: dict):
    from . import tables

    rows = [[c["codec"], c["download_codec"], c["up_bytes_per_param"], c["down_bytes_per_param"],
             c["total_bytes_per_param"], c["loss_max_rel_dev"]] for c in res["cases"]]
    return tables.table("2. bytes per parameter per peer per round (counted by the bucket)",
                        ["shards", "deltas", "up", "down", "total", "loss vs none (max rel.)"], rows)


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
