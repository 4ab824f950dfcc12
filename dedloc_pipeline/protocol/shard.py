"""Gradient shards: what a peer uploads for a round (the checks that admit one: checks/validation.py).

A shard is the codec's zarr arrays followed by its manifest (data first, marker last). The
manifest says who computed it, on how many samples (and which: the peer's own data stream), with
what codec, the hash of every chunk, and the hash of the COMMIT of the state it was computed on
(unknowable before that state exists, so no shard can be made ahead for a future round), so the
scheduler can reject anything torn, corrupted, forged, premature or malformed. In a run
with an organizer key the manifest is signed by its volunteer (identity.py), which makes the
chunk hashes, round and peer in it unforgeable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..storage import vector
from ..storage.layout import LAYOUT_VERSION, PEER_ID
from ..trust import identity

if TYPE_CHECKING:  # at run time a shard needs no model: writers stay light (no torch)
    from .run import Run

class Rejected(ValueError):
    """A shard that does not count, with the reason recorded in CLOSE and the ledger; ``data``,
    once its volunteer's manifest is known to be its own, the samples it named (they still
    advance the stream, so an honest peer whose shard was refused is not refused again for the
    gap it leaves); ``check``: which check of ``checks/catalog.py`` refused it."""

    def __init__(self, reason: str, data: DataRef | None = None, check: str | None = None):
        super().__init__(reason)
        self.data, self.check = data, check


Index = Annotated[int, Field(ge=0, lt=1 << 48)]


class DataRef(BaseModel):
    stream: str
    # (first, count)
    ranges: list[tuple[Index, Annotated[int, Field(gt=0, lt=1 << 32)]]] = Field(min_length=1, max_length=64)

    def end(self) -> int:
        return max(a + c for a, c in self.ranges) if self.ranges else 0

    def indices(self) -> list[int]:
        """Every sample named, in the order claimed."""
        return [i for start, count in self.ranges for i in range(start, start + count)]


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
    inner_steps: list[int] | None = Field(None, description="diloco: the samples of each inner step, in order")
    precision: Literal["fp32", "bf16"] = "fp32"  # diloco: the volunteer's weights and inner steps
    data: DataRef
    checksums: dict[str, list[str]]
    state_hash: str = Field(pattern=r"^[0-9a-f]{64}$", description="commit_hash of COMMIT round")
    created_at: float
    signature: str | None = None  # Ed25519 over every other field (identity.canonical)

    def payload(self) -> dict:
        return self.model_dump(mode="json", exclude={"signature"})


class Entry(BaseModel):
    """An admitted shard as its round's CLOSE lists it: what its manifest says, what validation
    measured (``norm``, ``manifest_sha``), and what the close decided (``late``, ``weight``)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    peer: str
    part: str
    round: int
    samples: int
    loss: float
    stale_samples: int
    inner_steps: list[int] | None = None  # diloco: what the validator replays (recompute.py)
    precision: Literal["fp32", "bf16"] = "fp32"
    checksums: dict[str, list[str]]
    data: DataRef
    norm: float | None = None  # None: its contents not checked before CLOSE (volunteer aggregators check them)
    late: bool = False  # folded from the round before (close.late_shards="fold")
    manifest_sha: str
    weight: float | None = None  # its samples, capped (admission.weigh): set before CLOSE is written
    # local-steps mode: its count sketch (direction.sketch), for the direction screen; never in CLOSE
    _sketch: np.ndarray | None = PrivateAttr(default=None)

    def dump(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


def commit_hash(commit: dict) -> str:
    """What binds a shard to state r: the SHA-256 of COMMIT r (its JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(commit, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def upload(run: Run, r: int, peer: str, part: str, arrays: dict, samples: int, loss: float,
           data: DataRef, stale_samples: int = 0, signer: identity.Ed25519PrivateKey | None = None,
           abandoned: Callable[[], bool] = lambda: False, state_hash: str | None = None,
           inner_steps: list[int] | None = None, precision: str = "fp32") -> str | None:
    """Write a shard: chunks first, then the manifest (signed if given a key). Returns its key;
    None if ``abandoned()`` said so once the chunks were written (no manifest: no shard).
    ``state_hash``: commit_hash of COMMIT r, read here if not given."""
    key = run.keys.shard(r, peer, part)
    sums = vector.write_vector(run.bucket, key, run.grad_format, arrays)
    if abandoned():
        return None
    fmt = run.grad_format
    m = Manifest(layout_version=LAYOUT_VERSION, run=run.name, round=r, peer=peer, part=part,
                 codec=fmt.codec, n=fmt.n, chunk_size=fmt.chunk_size, block=fmt.block,
                 samples=samples, loss=loss, stale_samples=stale_samples, inner_steps=inner_steps,
                 precision=precision, data=data, checksums=sums,
                 state_hash=state_hash or commit_hash(run.commit_of(r)), created_at=run.clock.time())
    if signer is not None:
        m.signature = identity.sign(signer, m.payload())
    run.bucket.write_json(run.keys.manifest(key), m.model_dump(mode="json"))
    return key


