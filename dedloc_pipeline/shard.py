"""Gradient shards: what a peer uploads for a round, and the checks that admit one.

A shard is the codec's zarr arrays followed by its manifest (data first, marker last). The
manifest says who computed it, on how many samples (and which), with what codec, and the hash of
every chunk, so the scheduler can reject anything torn, corrupted, forged or malformed.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import codec
from .layout import LAYOUT_VERSION

if TYPE_CHECKING:  # at run time a shard needs no model: writers stay light (no torch)
    from .run import Run

PEER_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class Rejected(ValueError):
    """A shard that does not count, with the reason recorded in CLOSE and the ledger."""


class DataRef(BaseModel):
    stream: str
    ranges: list[tuple[int, int]]  # (first index, count)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layout_version: int
    run: str
    round: int = Field(ge=0)
    peer: str = Field(pattern=PEER_ID)
    part: str = Field(pattern=PEER_ID)
    codec: str
    n: int
    chunk_size: int
    block: int
    samples: int = Field(gt=0)
    loss: float
    stale_samples: int = Field(0, ge=0, description="computed on the state before this round's")
    data: DataRef
    checksums: dict[str, list[str]]
    created_at: float


def upload(run: Run, r: int, peer: str, part: str, arrays: dict,
           samples: int, loss: float, data: DataRef, stale_samples: int = 0) -> str:
    """Write a shard: chunks first, then the manifest. Returns the shard's key."""
    key = run.keys.shard(r, peer, part)
    sums = codec.write_vector(run.bucket, key, run.grad_format, arrays)
    fmt = run.grad_format
    m = Manifest(layout_version=LAYOUT_VERSION, run=run.name, round=r, peer=peer, part=part,
                 codec=fmt.codec, n=fmt.n, chunk_size=fmt.chunk_size, block=fmt.block,
                 samples=samples, loss=loss, stale_samples=stale_samples, data=data,
                 checksums=sums, created_at=time.time())
    run.bucket.write_json(run.keys.manifest(key), m.model_dump(mode="json"))
    return key


def validate(run: Run, r: int, key: str, raw: bytes) -> dict:
    """Admit a shard of round r or raise Rejected. Reads every chunk once."""
    try:
        m = Manifest.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise Rejected(f"malformed manifest: {str(exc).splitlines()[0]}") from exc
    fmt = run.grad_format
    _, _, _, peer, part = key.rsplit("/", 4)
    expect = {"layout_version": LAYOUT_VERSION, "run": run.name, "round": r, "peer": peer,
              "part": part, "codec": fmt.codec, "n": fmt.n, "chunk_size": fmt.chunk_size,
              "block": fmt.block}
    for field, want in expect.items():
        if getattr(m, field) != want:
            raise Rejected(f"manifest {field}={getattr(m, field)!r}, expected {want!r}")
    for name, (_, _, _) in fmt.arrays().items():
        if len(m.checksums.get(name, [])) != fmt.n_chunks:
            raise Rejected(f"manifest lists {len(m.checksums.get(name, []))} chunks of {name}")
    if not math.isfinite(m.loss):
        raise Rejected("non-finite loss")
    if sum(c for _, c in m.data.ranges) != m.samples:
        raise Rejected("data ranges do not add up to the sample count")
    try:
        arrays = codec.read_vector(run.bucket, key, fmt, checksums=m.checksums, raw=True)
    except codec.CorruptShard as exc:
        raise Rejected(str(exc)) from exc
    if not all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f"):
        raise Rejected("non-finite gradient values")
    norm = math.sqrt(codec.squared_norm(arrays, fmt.codec, fmt.block))
    if norm > run.config.max_grad_norm:
        raise Rejected(f"gradient norm {norm:.3g} above the bound {run.config.max_grad_norm:.3g}")
    return {"key": key, "peer": m.peer, "part": m.part, "round": r, "samples": m.samples,
            "loss": m.loss, "stale_samples": m.stale_samples, "checksums": m.checksums,
            "data": m.data.model_dump(mode="json"), "norm": norm, "late": False,
            "manifest_sha": hashlib.sha256(raw).hexdigest()}
