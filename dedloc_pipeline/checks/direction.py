"""The direction screen: which way each volunteer's shard points, against the median volunteer.

In the local-steps mode (``algorithm: diloco``) no shard is recomputed, so a volunteer could send
its pseudo-gradient reversed, and the norm screen (``admission.norm_screen``) would let it through at up
to ten times the median norm: one volunteer in four erased a run's progress that way. So the
scheduler sketches every shard as it validates it (a count sketch: each element added, with a
hashed sign, to one of ``SKETCH`` hashed buckets; inner products, and so cosines, survive it to
about 1/sqrt(SKETCH)), and before CLOSE compares each volunteer (its shards' weighted sum) with
the coordinate-wise median of all volunteers' sketches. A volunteer pointing away from it (cosine
below ``close.min_agreement``) has its shards rejected. A large model is sketched on
``SAMPLED_CHUNKS`` of its chunks, drawn for each round from a secret of this scheduler process,
so a volunteer cannot know which parts of its shard are looked at.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ..storage import codec
from ..storage.vector import VectorFormat

SKETCH = 4096  # buckets: cosines to about 0.016, 32 KB a shard in the scheduler's memory
SAMPLED_CHUNKS = 8  # at most: 8M elements of 1M-element chunks, about 0.1 s a shard
_MULT_BUCKET, _MULT_SIGN = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_SECRET = os.urandom(16)  # this process's: which chunks are sketched is nobody else's to know


def sampled(n_chunks: int, r: int) -> list[int]:
    """The chunks round r's shards are sketched on: all of a small vector's, else
    ``SAMPLED_CHUNKS`` of them drawn from this process's secret (the same for every shard of the
    round, so their sketches compare)."""
    if n_chunks <= SAMPLED_CHUNKS:
        return list(range(n_chunks))
    seed = int.from_bytes(hashlib.sha256(_SECRET + r.to_bytes(8, "little")).digest()[:8], "little")
    return sorted(np.random.default_rng(seed).choice(n_chunks, SAMPLED_CHUNKS, replace=False).tolist())


def sketch(fmt: VectorFormat, arrays: dict[str, np.ndarray], chunks: list[int]) -> np.ndarray:
    """The count sketch of a shard (its raw arrays) over ``chunks``, decoded a chunk at a time."""
    out = np.zeros(SKETCH, np.float64)
    for c in chunks:
        chunk = range(c, c + 1)
        part = {name: arrays[name][slice(*fmt.bounds(name, chunk))] for name in fmt.arrays()}
        values = codec.decode(part, fmt.codec, fmt.block, fmt.elements(chunk)).astype(np.float64)
        i = np.arange(c * fmt.chunk_size, c * fmt.chunk_size + len(values), dtype=np.uint64)
        bucket = ((i * _MULT_BUCKET) >> np.uint64(52)).astype(np.int64) % SKETCH
        sign = np.where(((i * _MULT_SIGN) >> np.uint64(63)) == 1, -1.0, 1.0)
        out += np.bincount(bucket, weights=sign * values, minlength=SKETCH)
    return out


def agreement(by_volunteer: dict[str, np.ndarray]) -> dict[str, float]:
    """Each volunteer's cosine with the coordinate-wise median of all the volunteers' sketches
    (three or more: with two, neither is the majority)."""
    if len(by_volunteer) < 3:
        return {}
    median = np.median(np.stack(list(by_volunteer.values())), axis=0)
    ref = np.linalg.norm(median)
    return {v: float(s @ median / (np.linalg.norm(s) * ref)) if ref > 0 and np.linalg.norm(s) > 0 else 0.0
            for v, s in by_volunteer.items()}
