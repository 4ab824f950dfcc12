"""Benchmark 3: how close the scheduler's reduction of one round comes to what the bytes allow.

Sixteen peers upload int8 shards of a 10M-parameter gradient to a ``file://`` bucket. The round is
then reduced the way the scheduler does it, and compared with a lower bound measured in the same
process on the same files: plain Python reads of the shards' zarr chunk files, Blosc-lz4
decompression, int8 codes times per-block scales, and the sample-weighted sum in memory (one
core). Timed, best of ``repeats`` after one warm-up, page cache warm for all of them:

- ``lower_bound``: the plain-numpy read, decode and weighted sum;
- ``reduce_parallel`` / ``reduce_serial``: ``aggregation.reduce_part`` for every part of the closed
  round, on a pool of 2 threads as ``Scheduler.finish`` runs it, and one part after the other;
- ``validate``: ``Scheduler.try_close`` of the round (every shard read in full and checked), with
  a fresh Scheduler each time so no verdict is cached;
- ``round``: the whole round, ``try_close`` and ``finish`` (reduce, optimizer step, commit).

The ratios to the lower bound say how much of the scheduler's time is overhead rather than the
unavoidable read, decode and sum; the bucket request counts say what the same round costs on S3.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numcodecs
import numcodecs.blosc
import numpy as np

from benchmarks.synthetic_round import io_delta, peer_samples, synthetic_gradient, vector_run
from dedloc_pipeline.compute import aggregation
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.protocol.shard import DataRef, upload
from dedloc_pipeline.storage import codec, vector
from dedloc_pipeline.storage.bucket import Bucket

ROUND = 0


def reset_round(run: Run, r: int, keep_close: bool = False) -> None:
    """Remove what closing and finishing round r wrote, so the next attempt recomputes it."""
    bucket, keys = run.bucket, run.keys
    if not keep_close:
        bucket.delete(keys.close(r))
    bucket.delete(f"{keys.round(r)}/reduced")
    bucket.delete(keys.state(r + 1))
    bucket.write_json(keys.latest, {"state": r})


def best_of(fn, repeats: int, reset=None, bucket: Bucket | None = None) -> dict:
    """One warm-up, then the best of ``repeats`` timed calls of ``fn``; ``reset`` runs untimed
    before each call. With ``bucket``, also the bucket traffic of one call."""
    times, io = [], None
    for i in range(repeats + 1):
        if reset is not None:
            reset()
        before = bucket.stats.snapshot() if bucket is not None else None
        t = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t
        if bucket is not None:
            io = io_delta(before, bucket.stats.snapshot())
        if i:
            times.append(elapsed)
    out = {"seconds": min(times), "all_seconds": times}
    if io is not None:
        out["io"] = io
    return out


def numpy_reduce(root: str, run: Run, accepted: list[dict]) -> np.ndarray:
    """The lower bound: the round's mean gradient straight from the shards' files.

    Chunk by chunk (a 1M-element float64 accumulator stays small), every shard's codes and
    scales are read with plain file reads (a shard keeps its chunks in one file, their offsets
    in its index, each chunk its codes then its scales), Blosc-decompressed, dequantized as codes
    times their block's scale,
    weighted by its samples and summed in float64.
    """
    fmt = run.grad_format
    codes_dtype = np.dtype(fmt.arrays()["codes"][0])
    codes_bytes = codes_dtype.itemsize * fmt.arrays()["codes"][2]  # a packed chunk: codes, then scales
    blosc = numcodecs.Blosc()
    total_samples = sum(s["samples"] for s in accepted)
    out = np.empty(fmt.n, np.float32)
    weighted = np.empty(fmt.chunk_size, np.float64)
    index = {s["key"]: _shard_index(f"{root}/{s['key']}/{vector.PACKED}/c/0", fmt.n_chunks) for s in accepted}
    for c in range(fmt.n_chunks):
        lo, hi = fmt.bounds("codes", range(c, c + 1))
        acc = np.zeros(hi - lo, np.float64)
        for s in accepted:
            packed = np.frombuffer(blosc.decode(_read_chunk(root, s["key"], index, c)), np.uint8)
            g = code_values(packed[:codes_bytes].tobytes(), codes_dtype)  # a whole chunk, the last one padded
            scales = packed[codes_bytes:].view(np.float32)
            blocks = g.reshape(len(scales), fmt.block)  # a view: scaled in place
            blocks *= scales[:, None]
            np.multiply(g[: hi - lo], np.float64(s["samples"]), out=weighted[: hi - lo])
            acc += weighted[: hi - lo]
        out[lo:hi] = acc / total_samples
    return out


def _shard_index(path: str, chunks: int) -> np.ndarray:
    """(offset, bytes) of each chunk in a zarr shard file: its last 16 bytes a chunk and a CRC32C."""
    with open(path, "rb") as f:
        f.seek(-(16 * chunks + 4), 2)
        return np.frombuffer(f.read(16 * chunks), "<u8").reshape(chunks, 2)


def _read_chunk(root: str, key: str, index: dict, c: int) -> bytes:
    offset, size = index[key][c]
    with open(f"{root}/{key}/{vector.PACKED}/c/0", "rb") as f:
        f.seek(int(offset))
        return f.read(int(size))


def code_values(raw: bytes, dtype: np.dtype) -> np.ndarray:
    """Stored int8 codes as float32: two's complement (int8), or zigzag-folded (uint8, layout 2)."""
    codes = np.frombuffer(raw, dtype)
    if dtype == np.uint8:
        codes = (codes >> 1).view(np.int8) ^ -(codes & 1).view(np.int8)
    elif dtype != np.int8:
        raise TypeError(f"no plain decoding of {dtype} codes")
    return codes.astype(np.float32)


def write_round(run: Run, shards: int) -> float:
    """Every peer's int8 shard and manifest for the round; returns the seconds it took."""
    t = time.perf_counter()
    fmt = run.grad_format
    for i in range(shards):
        peer = f"peer{i:03d}"
        arrays = codec.encode(synthetic_gradient(fmt.n, seed=i), fmt.codec, fmt.block)
        samples = peer_samples(i)
        upload(run, ROUND, peer, "p0", arrays, samples, loss=5.0 + 0.01 * i,
               data=DataRef(stream=peer, ranges=[(0, samples)]))
    return time.perf_counter() - t


def run(n: int = 10_000_000, shards: int = 16, repeats: int = 3) -> dict:
    """Benchmark 3 on a temporary ``file://`` bucket; a JSON-able dict of every number."""
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="dedloc-bench-agg-")
    try:
        bucket = Bucket(f"file://{root}")
        vrun = vector_run(bucket, "agg", n, target_batch_size=sum(peer_samples(i) for i in range(shards)))
        write_s = write_round(vrun, shards)
        parts = range(vrun.n_parts)

        def validate():
            assert Scheduler(vrun).try_close(ROUND) is not None, "round did not close"

        validated = best_of(validate, repeats, reset=lambda: reset_round(vrun, ROUND), bucket=bucket)
        close = bucket.read_json(vrun.keys.close(ROUND))
        assert len(close["accepted"]) == shards, close["rejected"]

        blosc_threads = numcodecs.blosc.use_threads
        numcodecs.blosc.use_threads = False  # one core: Blosc would otherwise use both here
        try:
            lower = best_of(lambda: numpy_reduce(root, vrun, close["accepted"]), repeats)
        finally:
            numcodecs.blosc.use_threads = blosc_threads

        def reset_reduced():
            reset_round(vrun, ROUND, keep_close=True)

        with ThreadPoolExecutor(2) as pool:
            reduce_parallel = best_of(
                lambda: list(pool.map(lambda k: aggregation.reduce_part(vrun, ROUND, k), parts)),
                repeats, reset=reset_reduced, bucket=bucket)
            reduce_serial = best_of(lambda: [aggregation.reduce_part(vrun, ROUND, k) for k in parts],
                                    repeats, reset=reset_reduced, bucket=bucket)
            reduced = vector.read_vector(bucket, vrun.keys.reduced(ROUND), vrun.dense_format)
            expected = numpy_reduce(root, vrun, close["accepted"])
            disagreement = float(np.abs(reduced - expected).max() / np.abs(expected).max())

            def whole_round():
                scheduler = Scheduler(vrun)
                assert scheduler.try_close(ROUND) is not None, "round did not close"
                scheduler.finish(ROUND, pool)

            whole = best_of(whole_round, repeats, reset=lambda: reset_round(vrun, ROUND), bucket=bucket)
            assert vrun.latest() == ROUND + 1

        shard_bytes = sum(p.stat().st_size for p in _chunk_files(root, vrun))
        timings = {
            "lower_bound": {**lower, "what": "plain file reads of every shard chunk, Blosc-lz4 decode, "
                            "codes x block scales, float64 sample-weighted sum; one core, no bucket"},
            "reduce_parallel": {**reduce_parallel, "what": "aggregation.reduce_part for every part, "
                                "2 threads as Scheduler.finish (writes the reduced gradient too)"},
            "reduce_serial": {**reduce_serial, "what": "aggregation.reduce_part for every part, "
                              "one after the other"},
            "validate": {**validated, "what": "Scheduler.try_close: list, read every manifest, "
                         "read+checksum+decode every shard, finiteness and norm, write CLOSE"},
            "round": {**whole, "what": "try_close + finish (reduce, AdamW apply, commit), "
                      "2 threads"},
        }
        for t in timings.values():
            t["ratio"] = t["seconds"] / lower["seconds"]
        return {
            "benchmark": "aggregation (3)",
            "what": "one int8 round of `shards` peers on a file:// bucket: scheduler steps against "
                    "a plain-numpy read+decode+sum lower bound; seconds are best of `repeats` after a "
                    "warm-up, ratio is to the lower bound, io is the bucket traffic of one call",
            "n": n, "shards": shards, "repeats": repeats, "codec": vrun.config.codec,
            "chunk_size": vrun.config.chunk_size, "chunks_per_part": vrun.config.chunks_per_part,
            "n_chunks": vrun.grad_format.n_chunks, "n_parts": vrun.n_parts, "block": vrun.config.block_size,
            "shard_chunk_bytes": shard_bytes,
            "shard_compression": shard_bytes / (shards * (n + 4 * -(-n // vrun.config.block_size))),
            "write_shards_s": write_s,
            "timings": timings,
            "lower_bound_disagreement": disagreement,
            "lower_bound_disagreement_what": "max |reduced - lower bound| / max |lower bound|: the "
                                             "two compute the same mean (float32 rounding apart)",
            "runtime_s": time.perf_counter() - started,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _chunk_files(root: str, vrun: Run) -> list[Path]:
    """The zarr chunk files of the round's shards (what the lower bound reads)."""
    keys = vrun.keys
    return [Path(root, k) for k in keys.of_round(vrun.bucket.find(keys.volunteers_dir), ROUND, "object")
            if k.rsplit("/", 2)[1] == "c"]


def table(res: dict):
    from . import tables

    rows = [[k, v["seconds"], v.get("ratio", "-")] for k, v in res["timings"].items()]
    return tables.table("3. aggregation: 16 int8 shards of 10M parameters, file://",
                        ["step", "seconds", "× lower bound"], rows)


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
