"""Benchmark 5: what one round costs the scheduler as the number of peers grows.

For 16, 64 and 256 simulated peers (and a 4x larger vector at the two smallest counts), light
writer processes upload a real int8 shard and manifest per peer for round 0 of a ``file://`` run.
The main process then times the scheduler's two steps separately, ``try_close`` (validation:
every shard read in full and checked) and ``finish`` (reduce, AdamW apply, commit, 2 threads),
and counts the requests and bytes its bucket served. Writing the shards is timed on its own and
is not part of the aggregation cost.

The measurements are fitted as seconds = a + b * peers * params (least squares; also with a
c * params term for the optimizer step) and requests or bytes = c0 + c1 * size + peers * (d0 +
d1 * size), size being chunks per shard for requests and parameters for bytes, then
extrapolated to 1000 peers for 1M parameters and for the sahajbert preset: the scheduler's
budget per round when a collaboration reaches DeDLOC's scale.

The writers are spawned processes that must stay light (numpy, zarr and the project's torch-free
storage, run and shard modules): this module and benchmarks/synthetic_round.py import nothing
heavy at module level, because spawned children import them, and the main-process steps import
the torch-dependent modules inside ``measure`` and ``vector_run``.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from benchmarks.synthetic_round import io_delta, peer_samples, synthetic_gradient, vector_run
from dedloc_pipeline.protocol.clock import REAL, Clock
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.codec import encode
from dedloc_pipeline.storage.layout import RunLayout
from dedloc_pipeline.storage.vector import VectorFormat

ROUND = 0
# build_model("sahajbert", 0): sum of parameter sizes (measured once; building it takes ~30 s here).
SAHAJBERT_PARAMS = 18_105_474


# Writer side: runs in the spawned processes.

@dataclass(frozen=True)
class ShardTarget:
    """What ``shard.upload`` uses of a Run, built from run.json and the vector size alone."""

    bucket: Bucket
    keys: RunLayout
    name: str
    grad_format: VectorFormat
    state_hash: str  # of the COMMIT round ROUND is computed on
    clock: Clock = REAL  # the manifest's creation time


@functools.lru_cache(maxsize=None)
def _target(url: str, run_name: str, n: int) -> ShardTarget:
    from dedloc_pipeline.protocol.shard import commit_hash

    bucket, keys = Bucket(url), RunLayout(run_name)
    cfg = bucket.read_json(keys.config)
    return ShardTarget(bucket, keys, run_name,
                       VectorFormat(cfg["codec"], n, cfg["chunk_size"], cfg["block_size"], whole=True),
                       commit_hash(bucket.read_json(keys.commit(ROUND))))


def _write_shard(job: tuple[str, str, int, int]) -> None:
    """Encode and upload peer i's shard of round 0 (chunks, then its manifest)."""
    from dedloc_pipeline.protocol.shard import DataRef, upload

    url, run_name, n, i = job
    target = _target(url, run_name, n)
    fmt = target.grad_format
    peer, samples = f"peer{i:04d}", peer_samples(i)
    upload(target, ROUND, peer, "p0", encode(synthetic_gradient(n, seed=i), fmt.codec, fmt.block),
           samples, loss=5.0 + 1e-3 * i, data=DataRef(stream=peer, ranges=[(0, samples)]),
           state_hash=target.state_hash)


def _torch_loaded(_: int) -> bool:
    return "torch" in sys.modules


# Scheduler side: the main process.

# Cost models: term name -> its value at (peers, params, chunks per shard).
TIME = {"a": lambda p, n, c: 1.0, "b": lambda p, n, c: p * n}
TIME_WITH_STATE = {**TIME, "c": lambda p, n, c: n}  # c: what grows with the state alone (apply)
REQUESTS = {"c0": lambda p, n, c: 1.0, "c1": lambda p, n, c: c,
            "d0": lambda p, n, c: p, "d1": lambda p, n, c: p * c}
BYTES = {"c0": lambda p, n, c: 1.0, "c1": lambda p, n, c: n,
         "d0": lambda p, n, c: p, "d1": lambda p, n, c: p * n}
STEPS = ("validate", "finish", "aggregate")


def fit(terms: dict, cases: list[dict], y: list[float]) -> dict:
    """Least squares of y over the terms at each case; coefficients, R² and largest residual."""
    X = np.array([[f(case["peers"], case["n_params"], case["chunks"]) for f in terms.values()]
                  for case in cases])
    y_ = np.asarray(y, float)
    coef, *_ = np.linalg.lstsq(X, y_, rcond=None)
    residual = y_ - X @ coef
    ss_tot = float(((y_ - y_.mean()) ** 2).sum())
    return {**dict(zip(terms, map(float, coef))),
            "r2": 1.0 - float((residual ** 2).sum()) / ss_tot if ss_tot else 1.0,
            "max_residual": float(np.abs(residual).max())}


def fit_all(cases: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Every fitted quantity of a whole round: name -> (model terms, fitted coefficients)."""
    kinds = sorted({k for case in cases for k in case["requests_by_kind"]})
    series = {
        **{f"{step}_s": (TIME, [case[f"{step}_s"] for case in cases]) for step in STEPS},
        "aggregate_with_state_term_s": (TIME_WITH_STATE, [case["aggregate_s"] for case in cases]),
        **{f"requests_{k}": (REQUESTS, [case["requests_by_kind"].get(k, 0) for case in cases])
           for k in kinds},
        **{field: (BYTES, [case[field] for case in cases]) for field in ("bytes_read", "bytes_written")},
    }
    return {name: (terms, fit(terms, cases, y)) for name, (terms, y) in series.items()}


def extrapolate(fits: dict[str, tuple[dict, dict]], peers: int, params: int, chunk_size: int) -> dict:
    """Every fitted quantity at ``peers`` peers of ``params`` parameters."""
    chunks = -(-params // chunk_size)
    out = {name: sum(coef[k] * f(peers, params, chunks) for k, f in terms.items())
           for name, (terms, coef) in fits.items()}
    out = {k: round(v) if not k.endswith("_s") else v for k, v in out.items()}
    out["requests_total"] = sum(v for k, v in out.items() if k.startswith("requests_"))
    return {"peers": peers, "n_params": params, "chunks": chunks, **out}


def _sum_io(a: dict, b: dict) -> dict:
    """Bucket traffic of two steps together."""
    kinds = sorted(set(a["requests"]) | set(b["requests"]))
    return {"requests": {k: a["requests"].get(k, 0) + b["requests"].get(k, 0) for k in kinds},
            "bytes_read": a["bytes_read"] + b["bytes_read"],
            "bytes_written": a["bytes_written"] + b["bytes_written"]}


def measure(bucket: Bucket, writers, threads: ThreadPoolExecutor, peers: int, n: int) -> dict:
    """One round of ``peers`` shards of ``n`` parameters: write, validate, finish."""
    from dedloc_pipeline.organizer.scheduler import Scheduler

    name = f"scale-{peers}p-{n}"
    vrun = vector_run(bucket, name, n, target_batch_size=sum(peer_samples(i) for i in range(peers)))
    t = time.perf_counter()
    writers.map(_write_shard, [(bucket.url, name, n, i) for i in range(peers)], chunksize=4)
    write_s = time.perf_counter() - t

    scheduler = Scheduler(vrun)
    before, t = bucket.stats.snapshot(), time.perf_counter()
    close = scheduler.try_close(ROUND)
    validate_s, validate_io = time.perf_counter() - t, io_delta(before, bucket.stats.snapshot())
    assert close is not None and len(close.accepted) == peers, "not every shard was accepted"
    before, t = bucket.stats.snapshot(), time.perf_counter()
    scheduler.finish(ROUND, threads)
    finish_s, finish_io = time.perf_counter() - t, io_delta(before, bucket.stats.snapshot())
    assert vrun.latest() == ROUND + 1
    bucket.delete(vrun.keys.root)
    io = _sum_io(validate_io, finish_io)
    return {"peers": peers, "n_params": n, "chunk_size": vrun.config.chunk_size,
            "chunks": vrun.grad_format.n_chunks, "parts": vrun.n_parts,
            "write_s": write_s, "validate_s": validate_s, "finish_s": finish_s,
            "aggregate_s": validate_s + finish_s, "per_peer_ms": 1e3 * (validate_s + finish_s) / peers,
            "requests": sum(io["requests"].values()), "requests_by_kind": io["requests"],
            "bytes_read": io["bytes_read"], "bytes_written": io["bytes_written"],
            "validate_io": validate_io, "finish_io": finish_io}


def run(peers=(16, 64, 256), n: int = 1_000_000) -> dict:
    """Benchmark 5 on a temporary ``file://`` bucket; a JSON-able dict of every number."""
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="dedloc-bench-scale-")
    configs = [(p, n) for p in peers] + [(p, 4 * n) for p in sorted(peers)[:2]]
    try:
        bucket = Bucket(f"file://{root}")
        writers = mp.get_context("spawn").Pool(2)
        try:
            writers.map(_torch_loaded, range(2))  # the writers' start-up is not timed
            with ThreadPoolExecutor(2) as threads:
                cases = [measure(bucket, writers, threads, p, size) for p, size in configs]
            writers_torch = any(writers.map(_torch_loaded, range(8), chunksize=1))
        finally:
            writers.close()
            writers.join()
        fits = fit_all(cases)
        reported = {name: coef for name, (_, coef) in fits.items()}
        for step in STEPS:
            b = reported[f"{step}_s"]["b"]
            reported[f"{step}_s"].update(per_peer_ms_at_1M=1e3 * b * 1e6,
                                         per_peer_ms_at_sahajbert=1e3 * b * SAHAJBERT_PARAMS)
        chunk_size = cases[0]["chunk_size"]
        return {
            "benchmark": "scale (5)",
            "what": "one int8 round per case on a file:// bucket: shards written by 2 spawned light "
                    "processes, then the scheduler's try_close (validate) and finish (reduce, AdamW "
                    "apply, commit; 2 threads) timed once each, requests and bytes of its bucket",
            "writers_import_torch": writers_torch,
            "cases": cases,
            "fit": {"what": "least squares over the cases of a whole round: seconds = a + b peers params "
                            "(with_state_term: + c params, the optimizer step); requests of each kind = "
                            "c0 + c1 chunks + peers (d0 + d1 chunks); bytes the same in params", **reported},
            "extrapolation": {
                "what": "1000 peers from the fits: one scheduler process, 2 threads, file:// bucket "
                        "(page cache warm), int8 shards, the default chunk_size (1<<20) and one chunk "
                        "per part, AdamW (sahajbert's recipe uses LAMB, which reads the state once "
                        "more per round)",
                "1M": extrapolate(fits, 1000, 1_000_000, chunk_size),
                "sahajbert": extrapolate(fits, 1000, SAHAJBERT_PARAMS, chunk_size),
            },
            "runtime_s": time.perf_counter() - started,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(res: dict):
    from . import tables

    rows = [[c["peers"], c["n_params"], c["validate_s"], c["finish_s"], c["requests"]] for c in res["cases"]]
    return tables.table("5. scale: simulated peers per round (1M parameters)",
                        ["peers", "params", "validate s", "reduce+apply s", "requests"], rows)


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
