"""Validation: one shard judged by itself, as the scheduler reads its manifest.

Everything a manifest claims is checked against what the protocol knows before a byte of the
shard is read: its run, round, peer, part and codec, its volunteer's signature, the state it was
computed on, its samples (a run of its own stream, not far past where that stream was counted),
its objects' number and sizes. Then the shard is frozen (copied where only the organizer writes)
and its contents checked there: checksums, finite values, its norm. Each check is a function
of the shard's ``Claim`` that raises ``Rejected`` with the reason CLOSE records; their order is
``catalog.VALIDATION``'s.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from ..protocol.run import Run
from ..protocol.shard import DataRef, Entry, Manifest, Rejected, commit_hash
from ..storage import codec, vector
from ..storage.layout import LAYOUT_VERSION
from ..trust import identity


def manifest_limit(fmt: vector.VectorFormat) -> int:
    """The most bytes an honest manifest takes (fixed fields, a signature, a hash per chunk):
    anything larger is rejected before it is read."""
    return 4096 + 64 * fmt.n_chunks * len(fmt.arrays())


def stored_limit(fmt: vector.VectorFormat) -> int:
    """The most bytes an honest shard's files take: Blosc stores a chunk it cannot compress as
    it is, behind a 16-byte header; zarr's metadata is under a kilobyte per array."""
    raw = sum(np.dtype(dtype).itemsize * length for dtype, length, _ in fmt.stored().values())
    return raw + 64 * fmt.n_chunks * len(fmt.stored()) + 4096 * len(fmt.stored())


def stream_window(run: Run) -> int:
    """How far past its counted end a stream's next shard may start: an honest peer leaves gaps
    only by samples it computed and nobody counted (parts still in flight, a late shard, samples
    dropped as too stale), at most a round's worth each. Bounded, a volunteer cannot pick which
    samples of the data set it trains on, nor send its stream anywhere."""
    return (run.config.close.max_parts + 1) * run.config.target_batch_size


def max_claim(run: Run) -> int:
    """The most samples one shard may claim: a worker uploads once the round can fill, computes
    at most two target batches ahead while a round is sent and reduced (``worker.AHEAD``), and
    carries samples past a closed round once, never twice, so an honest part holds at most about
    two target batches and a few micro-batches. Twice that is refused as impossible; a claim so
    large would also cost the validator as much to recompute as two rounds."""
    return 4 * run.config.target_batch_size


@dataclass
class Claim:
    """One shard as validation judges it: its manifest and what it is judged against
    (``catalog.validate`` says what each is). Each check reads it, and may add to it (the
    parsed manifest, the entry, the arrays read)."""

    run: Run
    round: int
    key: str
    raw: bytes
    roster: identity.Roster | None = None
    stored: dict[str, int] | None = None
    state_hash: str | None = None
    stream_end: int | None = None
    inspect: Callable[[Entry, dict[str, np.ndarray]], None] | None = None
    contents: bool = True
    manifest: Manifest | None = None
    entry: Entry | None = None
    arrays: dict[str, np.ndarray] | None = None


def manifest(c: Claim) -> None:
    """It parses, and names this run, round, peer and part, the run's codec and chunking, and
    a checksum for every chunk."""
    try:
        m = c.manifest = Manifest.model_validate(json.loads(c.raw))
    except (ValueError, ValidationError) as exc:
        raise Rejected(f"malformed manifest: {str(exc).splitlines()[0]}") from exc
    fmt = c.run.grad_format
    _, peer, part = c.run.keys.shard_parts(c.key)
    expect = {"layout_version": LAYOUT_VERSION, "run": c.run.name, "round": c.round, "peer": peer,
              "part": part, "codec": fmt.codec, "n": fmt.n, "chunk_size": fmt.chunk_size,
              "block": fmt.block}
    for field, want in expect.items():
        if getattr(m, field) != want:
            raise Rejected(f"manifest {field}={getattr(m, field)!r}, expected {want!r}")
    for name, (_, _, _) in fmt.arrays().items():
        if len(m.checksums.get(name, [])) != fmt.n_chunks:
            raise Rejected(f"manifest lists {len(m.checksums.get(name, []))} chunks of {name}")


def signature(c: Claim) -> None:
    """In a signed run, signed with the key the roster has for its volunteer, not revoked."""
    if c.run.config.organizer_key is None:
        return
    m = c.manifest
    if m.signature is None:
        raise Rejected("unsigned shard in a run that requires signatures")
    if c.roster is None:
        raise Rejected("no roster signed by the organizer: nobody is enrolled yet")
    try:
        key = c.roster.key_of(m.peer)
    except identity.IdentityError as exc:
        raise Rejected(str(exc)) from exc
    if not identity.verify(key, m.payload(), m.signature):
        raise Rejected(f"signature does not match {m.peer.split('.', 1)[0]!r}'s enrolled key")


def own_stream(c: Claim) -> None:
    """Its samples are of its own peer's data stream. From here on the manifest is known to be
    its peer's own, so a rejection still spends the samples it names."""
    if c.manifest.data.stream != c.manifest.peer:
        raise Rejected(f"data of stream {c.manifest.data.stream!r}: a volunteer counts only its own stream")


def state(c: Claim) -> None:
    """Computed on this round's state: it names the hash of that state's COMMIT, which nobody
    could know before the state existed."""
    if c.manifest.state_hash != (c.state_hash or commit_hash(c.run.commit_of(c.round))):
        raise Rejected(f"computed on another state than round {c.round}'s (state_hash {c.manifest.state_hash[:12]}...)")


def claims(c: Claim) -> None:
    """Its loss, sample count and inner steps are possible ones (``max_claim``)."""
    run, m = c.run, c.manifest
    if not math.isfinite(m.loss) or m.loss < 0:  # a cross-entropy is never negative
        raise Rejected(f"impossible loss {m.loss}")
    if sum(n for _, n in m.data.ranges) != m.samples:
        raise Rejected("data ranges do not add up to the sample count")
    _check_inner_steps(run, m)
    if m.samples > max_claim(run):
        raise Rejected(f"claims {m.samples} samples, more than a shard can hold ({max_claim(run)})")


def stream(c: Claim) -> None:
    """Its samples are one run of its stream, after what the stream counted and not far past
    it (``stream_window``)."""
    if c.stream_end is None:
        c.stream_end = int(c.run.stream_ends(c.round).get(c.manifest.peer, 0))
    _check_contiguous(c.manifest.data, c.stream_end, stream_window(c.run))


def objects(c: Claim) -> None:
    """Every chunk object its format takes is stored, and no more bytes than that format takes."""
    fmt = c.run.grad_format
    if c.stored is None:
        c.stored = {k.removeprefix(c.key + "/"): n for k, n in c.run.bucket.sizes(c.key).items()}
    missing = sorted(vector.chunk_objects(fmt) - set(c.stored))
    if missing:  # zarr would read them as zeros: a shard of no data that checksums could still match
        raise Rejected(f"missing chunk objects: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    size = sum(c.stored.values())
    if size > stored_limit(fmt):
        raise Rejected(f"shard holds {size} bytes, more than its format takes ({stored_limit(fmt)})")


def contents(c: Claim) -> None:
    """Frozen where only the organizer writes, then its contents checked there
    (``check_contents``), unless they are left for after CLOSE (``contents`` False: its
    ``norm`` None); its CLOSE entry made."""
    m = c.manifest
    frozen = freeze(c.run, c.key)
    c.arrays, norm = check_contents(c.run, frozen, m.checksums) if c.contents else (None, None)
    c.entry = Entry(key=c.key, peer=m.peer, part=m.part, round=c.round, samples=m.samples, loss=m.loss,
                    stale_samples=m.stale_samples, inner_steps=m.inner_steps, precision=m.precision,
                    checksums=m.checksums, data=m.data, norm=norm, manifest_sha=hashlib.sha256(c.raw).hexdigest())


def inspected(c: Claim) -> None:
    """What the caller measures of the shard's values (the local-steps mode's sketch and loss
    screen: ``Judge``'s inspector), on the arrays read here, at no request; it may reject it."""
    if c.inspect is not None:
        c.inspect(c.entry, c.arrays)


class OutOfBounds(Rejected):
    """Values no honest computation gives (non-finite, a norm above the bound), checked against
    the manifest's checksums, so its volunteer's own: the scheduler flags it (``flags.out_of_bounds``)."""


def check_contents(run: Run, frozen: str, checksums: dict[str, list[str]]) -> tuple[dict[str, np.ndarray], float]:
    """A frozen shard's contents: its arrays and norm, or Rejected if its chunks are not those
    its manifest's checksums name, or hold non-finite values, or its norm is above the run's
    ``max_grad_norm``."""
    fmt = run.grad_format
    try:
        arrays = vector.read_vector(run.bucket, frozen, fmt, checksums=checksums, raw=True)
    except vector.CorruptShard as exc:
        raise Rejected(str(exc)) from exc
    if not all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f"):
        raise OutOfBounds("non-finite gradient values")
    norm = math.sqrt(codec.squared_norm(arrays, fmt.codec, fmt.block))
    if norm > run.config.max_grad_norm:
        raise OutOfBounds(f"gradient norm {norm:.3g} above the bound {run.config.max_grad_norm:.3g}")
    return arrays, norm


def freeze(run: Run, key: str) -> str:
    """Copy shard ``key``'s objects to its frozen key (``RunLayout.frozen``), which only the
    organizer writes, and return that key: what is validated there is what every aggregator and
    the validator read, whatever the volunteer writes to its own keys afterwards."""
    frozen = run.keys.frozen(key)
    for name in sorted(vector.chunk_objects(run.grad_format)):
        try:
            run.bucket.copy(f"{key}/{name}", f"{frozen}/{name}")
        except FileNotFoundError as exc:
            raise Rejected(f"{name} vanished while the shard was judged") from exc
    return frozen


def _check_inner_steps(run: Run, m: Manifest) -> None:
    """A diloco shard whose inner optimizer starts fresh (``inner_state: shard``) says how many
    samples each of its inner steps took, so the validator can replay them: positive counts that
    add up to its samples. Other shards say nothing of inner steps."""
    if run.config.algorithm != "diloco" or run.config.inner_state != "shard":
        if m.inner_steps is not None or m.precision != "fp32":
            raise Rejected("inner steps or a precision claimed outside diloco's inner_state: shard")
        return
    if m.inner_steps is None or not m.inner_steps:
        raise Rejected("no inner steps listed: the validator could not replay the shard")
    if min(m.inner_steps) < 1 or sum(m.inner_steps) != m.samples:
        raise Rejected(f"inner steps of {sum(m.inner_steps)} samples in all (each at least one), for a shard "
                       f"of {m.samples}")


def _check_contiguous(data: DataRef, end: int, window: int) -> None:
    """A shard's samples are one run of its stream, starting after what its stream already
    counted and not far past it (``stream_window``)."""
    for (a, c), (b, _) in zip(data.ranges, data.ranges[1:]):
        if a + c != b:
            raise Rejected(f"data ranges are not one contiguous run of the stream ({a}+{c}, then {b})")
    start = data.ranges[0][0]
    if start < end:
        raise Rejected(f"data starts at sample {start}: its stream already counted up to {end}")
    if start > end + window:
        raise Rejected(f"data starts at sample {start}, more than {window} past its stream's counted end {end}")
