"""A synthetic round for the scheduler benchmarks (3, aggregation, and 5, scale): a run over one
flat vector of any size, gradient-like shards and the samples behind each peer's, and the bucket
traffic of a step.

Benchmark 5's writers are spawned processes that import this module: it loads no torch at module
level (``vector_run``, which the main process calls, imports it).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from dedloc_pipeline.protocol.config import recipe_config
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage import vector
from dedloc_pipeline.storage.bucket import Bucket


@functools.lru_cache(maxsize=2)
def _heavy_tailed(n: int) -> np.ndarray:
    """2n elements of Gaussian noise around 1e-3 with a log-normal scale per element: heavy-tailed
    enough that int8 codes of it compress as real tiny-ALBERT gradient codes do (about 0.6 of
    their size with bit-shuffle + lz4). Made once per process; peers take windows of it."""
    rng = np.random.default_rng(n)
    scale = np.exp(1.25 * rng.standard_normal(2 * n, dtype=np.float32))
    return 1e-3 * scale * rng.standard_normal(2 * n, dtype=np.float32)


def synthetic_gradient(n: int, seed: int) -> np.ndarray:
    """A gradient-like float32 vector, different per seed (a window of the shared noise at a
    random offset, scaled by 0.5 to 2) and cheap to make; its norm stays far below 1e4."""
    rng = np.random.default_rng(seed)
    offset = int(rng.integers(n))
    return _heavy_tailed(n)[offset:offset + n] * np.float32(rng.uniform(0.5, 2.0))


def peer_samples(i: int) -> int:
    """Samples behind peer i's shard: 8 to 32, so the weighted mean differs from the plain one."""
    return 8 + 8 * (i % 4)


def vector_run(bucket: Bucket, name: str, n: int, **fields) -> Run:
    """A run whose flat vector is one parameter of ``n`` elements, with state 0 committed.

    ``init_run`` builds the preset's model; this writes the same run.json, parameters, empty
    optimizer state, COMMIT(0) and LATEST for a vector of any size. The returned Run must be the
    one every benchmark step uses: read back from run.json it would take the preset's size.
    """
    import torch

    from dedloc_pipeline.model.flat import FlatLayout

    cfg = recipe_config(name, "tiny", codec="int8", **fields)
    run = Run(bucket, name, cfg)
    run.flat = FlatLayout(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(n))}))
    keys = run.keys
    bucket.create_json(keys.config, cfg.model_dump(mode="json"))
    p0 = np.random.default_rng(n).standard_normal(n, dtype=np.float32) * 0.02
    sums = vector.write_vector(bucket, keys.params(0), run.dense_format, {"values": p0})  # optimizer state: zeros
    bucket.create_json(keys.commit(0), {
        "state": 0, "round": None, "step": 0, "samples": 0, "contributors": [], "loss": None,
        "checksums": {"params": sums["values"]}, "committed_at": time.time(), "n_params": n})
    bucket.write_json(keys.latest, {"state": 0})
    return run


def io_delta(before: dict, after: dict) -> dict:
    """Requests (by kind) and bytes between two ``IOStats.snapshot()`` calls."""
    kinds = sorted(set(before["requests"]) | set(after["requests"]))
    requests = {k: after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in kinds}
    return {"requests": {k: v for k, v in requests.items() if v},
            "requests_total": sum(requests.values()),
            "bytes_read": after["bytes_read"] - before["bytes_read"],
            "bytes_written": after["bytes_written"] - before["bytes_written"]}
