"""Aggregators: each owns a part (a range of chunks) of the flat vector for one round.

``reduce_part`` takes the sample-weighted mean of the accepted shards over its range (or a
robust estimate: ``robust.py``);
``apply_part`` runs the optimizer step on that range and writes the range of the next state.
Both read only immutable inputs (CLOSE, state r) and write deterministic outputs before their
marker, so running one twice, or after a crash, gives the same bytes. Once every part is
applied, ``ledger.commit`` writes the state's COMMIT.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..protocol.close import round_close
from ..protocol.run import Run, RunError
from ..storage import codec, vector
from ..storage.layout import volunteer_of
from ..storage.vector import VectorFormat
from . import optim, robust

log = logging.getLogger(__name__)
READ_BATCH = 32  # shards whose chunk range is read at once: requests overlap, memory stays bounded


def _chunks(run: Run, part: int, chunks: range | None) -> range:
    """The chunks a computation covers: the part's, or a range of them (an audit's, ``checks/audit.py``)."""
    whole = run.part_chunks(part)
    if chunks is None:
        return whole
    if chunks.start < whole.start or chunks.stop > whole.stop:
        raise ValueError(f"chunks {chunks} are not of part {part} ({whole})")
    return chunks


def read_part(run: Run, accepted: list, part: int,
              chunks: range | None = None) -> dict[str, dict | vector.CorruptShard]:
    """Each of ``accepted``'s shards over this part's chunks (or ``chunks`` of them), by key, from
    its frozen copy, held to its manifest's checksums there (a CorruptShard where it is not)."""
    out, chunks = {}, _chunks(run, part, chunks)
    for i in range(0, len(accepted), READ_BATCH):
        batch = accepted[i:i + READ_BATCH]
        found = vector.read_vectors(run.bucket, [run.keys.frozen(s.key) for s in batch], run.grad_format,
                                    chunks, [s.checksums for s in batch])
        out.update({s.key: arrays for s, arrays in zip(batch, found)})
    return out


def part_checks(run: Run, part: int, accepted: list, found: dict, chunks: range | None = None) -> list[list[float]]:
    """The check of this part (or of ``chunks`` of it) of each of ``accepted``'s shards
    (``found``: ``read_part`` of the same chunks), in their order: its sum of squares in each
    chunk, the same on any machine (decoded, then summed in numpy's pairwise order), or -1 in
    every chunk where they are not its manifest's, are malformed, or hold a non-finite value
    (checks/exchange.py merges the parts' checks into each shard's verdict; an audit recomputes
    a few chunks' sums, ``checks/audit.py``)."""
    fmt, chunks = run.grad_format, _chunks(run, part, chunks)
    out = []
    for s in accepted:
        arrays = found[s.key]
        try:
            if isinstance(arrays, vector.CorruptShard):
                raise ValueError(arrays)
            x = codec.decode(arrays, fmt.codec, fmt.block, fmt.elements(chunks))
            if not np.isfinite(x).all():
                raise ValueError("not finite")
            out.append([optim.sum_squares(x[i:i + fmt.chunk_size]) for i in range(0, len(x), fmt.chunk_size)])
        except (ValueError, IndexError):  # a sparse position out of its block, arrays of other sizes
            out.append([-1.0] * len(chunks))
    return out


def mean_gradient(run: Run, r: int, part: int, found: dict | None = None, chunks: range | None = None) -> np.ndarray:
    """Round r's mean gradient over this part's chunks (or ``chunks`` of them; its robust
    estimate), from the frozen copies of CLOSE's accepted shards, in CLOSE's order: a fixed
    summation order, so the same bytes on any machine (``optim``), and each coordinate's the same
    whatever chunks are computed with it (but for ``centered_clip``, which takes the part's norms).
    ``found``: those shards' arrays there, read already (``read_part``)."""
    keys, bucket = run.keys, run.bucket
    accepted = round_close(run, r).accepted
    chunks = _chunks(run, part, chunks)
    lo, hi = run.dense_format.bounds("values", chunks)
    fmt = run.grad_format
    volunteers = sorted({volunteer_of(s.peer) for s in accepted})
    robust_mode = run.config.aggregation != "mean" and len(volunteers) > 2
    row = {v: i for i, v in enumerate(volunteers)}
    weights = np.zeros(len(volunteers), np.float64)  # each volunteer's, capped by the scheduler
    for s in accepted:
        weights[row[volunteer_of(s.peer)]] += s.weight
    total = np.zeros(hi - lo, np.float64)
    stacked = np.zeros((len(volunteers) if robust_mode else 0, hi - lo), np.float32)  # a row per volunteer
    for i in range(0, len(accepted), READ_BATCH):
        batch = accepted[i:i + READ_BATCH]
        arrays_of = [found[s.key] for s in batch] if found is not None else vector.read_vectors(
            bucket, [keys.frozen(s.key) for s in batch], fmt, chunks, [s.checksums for s in batch])
        for shard, arrays in zip(batch, arrays_of):
            if isinstance(arrays, vector.CorruptShard):  # only the organizer writes frozen copies: refuse, never skip
                raise arrays
            if robust_mode:  # the volunteer's parts, sample-weighted
                k = row[volunteer_of(shard.peer)]
                codec.accumulate(stacked[k], arrays, fmt.codec, fmt.block, shard.weight / weights[k])
            else:
                codec.accumulate(total, arrays, fmt.codec, fmt.block, shard.weight)
    if robust_mode:
        return robust.aggregate(stacked, weights.tolist(), run.config)
    if not accepted:  # the checks after CLOSE left no shard (checks/exchange.py): the step has no gradient
        return total.astype(np.float32)
    return (total / float(np.add.reduce(weights))).astype(np.float32)


def reduce_part(run: Run, r: int, part: int) -> str:
    """Mean gradient of round r over this part's chunks, plus the optimizer's partial sums."""
    keys, bucket = run.keys, run.bucket
    marker = keys.reduced_marker(r, part)
    if bucket.exists(marker):
        return marker
    grad = mean_gradient(run, r, part)
    sums = vector.write_vector(bucket, keys.reduced(r), run.dense_format, {"values": grad}, run.part_chunks(part))
    partials = part_sums(run, r, part, grad) if run.config.aggregator_optimizer.name == "lamb" else []
    bucket.write_json(marker, {"part": part, "partials": partials, "checksums": sums})
    run.kept.put(keys.reduced(r), part, {"reduced": {"values": grad}}, sums)
    return marker


def part_sums(run: Run, r: int, part: int, grad: np.ndarray, state: tuple | None = None,
              chunks: range | None = None) -> list[dict[str, list[float]]]:
    """LAMB: this part's (or its ``chunks``') share of each tensor's [sum p^2, sum u^2], which
    its trust ratio needs whole (``optim.partials``), a chunk at a time: the reduction's second
    result, and what an audit recomputes for a few chunks. ``grad`` and ``state`` (as
    ``read_state`` gives it, already read, left unchanged): over the same chunks."""
    chunks = _chunks(run, part, chunks)
    p, slots, _ = read_state(run, r, part, residual=False, chunks=chunks) if state is None else state
    lo, size = run.dense_format.bounds("values", chunks)[0], run.dense_format.chunk_size
    return [optim.partials(run.config.aggregator_optimizer, run.flat, lo + i, p[i:i + size],
                           {n: a[i:i + size] for n, a in slots.items()}, grad[i:i + size], step=r + 1)
            for i in range(0, len(p), size)]


def norms(run: Run, r: int) -> dict[str, list[float]]:
    """LAMB: round r's sums over every part, which every part's step takes: those the scheduler
    recorded for its volunteer aggregators (``exchange.py``, one signed record), else the merged
    sums of the organizer's own reduction."""
    found = run.read_record(run.keys.norms(r), f"norms of round {r}", round=r)
    if found is not None:
        return found["norms"]
    markers = run.bucket.read_many([run.keys.reduced_marker(r, k) for k in range(run.n_parts)])
    if any(v is None for v in markers.values()):
        raise RunError(f"round {r}: LAMB needs every part reduced first")
    return optim.merge_partials([s for v in markers.values() for s in json.loads(v)["partials"]])


def read_state(run: Run, r: int, part: int, residual: bool = True, chunks: range | None = None) -> tuple:
    """State r over this part (or ``chunks`` of it): its parameters, optimizer slots by name, and
    the download codec's residual (None unless ``residual``), each a fresh array."""
    chunks = _chunks(run, part, chunks)
    fmt, keys = run.dense_format, run.keys
    p = vector.read_vector(run.bucket, keys.params(r), fmt, chunks).copy()
    state = {n: vector.read_vector(run.bucket, keys.optim(r, n), fmt, chunks).copy()
             for n in run.config.aggregator_optimizer.slots}
    res = vector.read_vector(run.bucket, keys.optim(r, "residual"), fmt, chunks).copy() if residual else None
    return p, state, res


def next_part(run: Run, r: int, part: int, grad: np.ndarray, norms: dict | None = None,
              state: tuple | None = None, chunks: range | None = None) -> dict[str, dict]:
    """The optimizer step on this part of state r (or on ``chunks`` of it, an audit's: every
    coordinate comes out as with the whole part): state r+1's vectors there, by name
    (``params``, ``delta`` and each optimizer slot, ``residual`` with a lossy delta), as arrays of
    their formats (``next_formats``), not yet written anywhere. ``state``: as ``read_state``
    gives it, already read (its arrays are stepped in place)."""
    chunks = _chunks(run, part, chunks)
    lo, _ = run.dense_format.bounds("values", chunks)
    p_old, state, residual = read_state(run, r, part, chunks=chunks) if state is None else state
    p = p_old.copy()
    optim.apply(run.config.aggregator_optimizer, run.flat, lo, p, state, grad, step=r + 1, norms=norms)
    # Peers download the delta, not the snapshot: what they can rebuild is what gets committed.
    cfg = run.config
    q, p_new, residual = codec.delta_encode(p_old, p, cfg.param_codec, cfg.block_size, residual)
    out = {"params": {"values": p_new}, "delta": q, **{n: {"values": a} for n, a in state.items()}}
    if residual is not None:
        out["residual"] = {"values": residual}
    return out


def next_formats(run: Run) -> dict[str, VectorFormat]:
    """The format of each of a state's vectors, by the names ``next_part`` gives them (the
    download codec's ``residual`` only where it is lossy)."""
    lossy = not codec.codec_of(run.config.param_codec).exact
    return {"params": run.dense_format, "delta": run.delta_format,
            **{n: run.dense_format for n in (*run.config.aggregator_optimizer.slots, *["residual"] * lossy)}}


def vector_key(base: str, name: str) -> str:
    """Where a state's vector ``name`` lies below ``base`` (a state's folder, or an aggregator's
    answer, which keeps the same paths: ``params``, ``delta``, ``optim/NAME``)."""
    return f"{base}/{name}" if name in ("params", "delta") else f"{base}/optim/{name}"


def write_part(bucket, base: str, run: Run, part: int, vectors: dict[str, dict]) -> dict[str, dict]:
    """Write ``next_part``'s vectors below ``base``, all at once (each write waits on the
    bucket: on the round's critical path, one after the other they add up); their chunk
    checksums, by vector."""
    formats, chunks = next_formats(run), run.part_chunks(part)
    with ThreadPoolExecutor(len(vectors)) as pool:
        sums = {name: pool.submit(vector.write_vector, bucket, vector_key(base, name), formats[name], arrays, chunks)
                for name, arrays in vectors.items()}
        return {name: job.result() for name, job in sums.items()}


def applied_marker(part: int, sums: dict[str, dict], by: list[str]) -> dict:
    """A part's applied marker: what COMMIT takes (its params' and delta's checksums), every
    vector's checksums, and who computed it (``organizer``, or the two volunteer aggregators
    whose answers agreed)."""
    return {"part": part, "checksums": {"params": sums["params"]["values"], "delta": sums["delta"]},
            "vectors": sums, "by": by}


def apply_part(run: Run, r: int, part: int) -> str:
    """Optimizer step for this range: writes state r+1's params, delta and optimizer state, and
    keeps them for the next round's step (``Run.kept``), as it took round r's reduced gradient."""
    keys, bucket = run.keys, run.bucket
    marker = keys.applied(r + 1, part)
    if bucket.exists(marker):
        return marker
    total = norms(run, r) if run.config.aggregator_optimizer.name == "lamb" else None
    vectors = next_part(run, r, part, _reduced(run, r, part), total, _kept_state(run, r, part))
    sums = write_part(bucket, keys.state(r + 1), run, part, vectors)
    bucket.write_json(marker, applied_marker(part, sums, ["organizer"]))
    run.kept.put(keys.state(r + 1), part, {n: v for n, v in vectors.items() if n != "delta"}, sums)
    return marker


def _record(run: Run, key: str, field: str) -> dict | None:
    """``field`` of the marker at ``key``; None where there is none, or it is unreadable (the
    bucket's copy is read instead of what this process kept)."""
    try:
        found = run.bucket.read_json(key)
    except ValueError:
        return None
    return found.get(field) if isinstance(found, dict) else None


def _reduced(run: Run, r: int, part: int) -> np.ndarray:
    """Round r's reduced gradient over this part: as this process wrote it, or read."""
    held = run.kept.take(run.keys.reduced(r), part, lambda: _record(run, run.keys.reduced_marker(r, part), "checksums"))
    if held is not None:
        return held["reduced"]["values"]
    return vector.read_vector(run.bucket, run.keys.reduced(r), run.dense_format, run.part_chunks(part)).copy()


def _kept_state(run: Run, r: int, part: int) -> tuple | None:
    """State r over this part as ``read_state`` gives it, if this process wrote it (None: read it)."""
    held = run.kept.take(run.keys.state(r), part, lambda: _record(run, run.keys.applied(r, part), "vectors"))
    if held is None:
        return None
    slots = {n: held[n]["values"] for n in run.config.aggregator_optimizer.slots}
    return held["params"]["values"], slots, held["residual"]["values"] if "residual" in held else None
