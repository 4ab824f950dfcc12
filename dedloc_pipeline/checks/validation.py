"""Validation: one shard judged by itself, as the scheduler reads its manifest.

Everything a manifest claims is checked against what the protocol knows before a byte of the
shard is read: its run, round, peer, part and codec, its volunteer's signature, the state it was
computed on, its samples (a run of its own stream, not far past where that stream was counted),
its objects' number and sizes. Then the shard is frozen (copied where only the organizer writes)
and its contents checked there: checksums, finite values, its norm. A shard that fails raises
``Rejected`` with the reason CLOSE records.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable

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
    at most a target batch ahead while a round is reduced, and carries samples past a closed
    round once, never twice, so an honest part holds at most about two target batches. Twice
    that is refused as impossible; a claim so large would also cost the validator as much to
    recompute as a whole round."""
    return 4 * run.config.target_batch_size


def validate(run: Run, r: int, key: str, raw: bytes, roster: identity.Roster | None = None,
             stored: dict[str, int] | None = None, state_hash: str | None = None,
             stream_end: int | None = None,
             inspect: Callable[[Entry, dict[str, np.ndarray]], None] | None = None,
             contents: bool = True) -> Entry:
    """Admit a shard of round r or raise Rejected. Reads every chunk once, after every check
    that needs only the manifest and the shard's stored objects (``stored``: their sizes by
    name under the shard, from a listing the caller made of many shards at once; listed here
    if not given). ``stream_end``: where the peer's stream was counted to as of state r (its
    streams record; read here if not given). ``inspect(entry, arrays)``: what the caller
    measures of the shard's values (the local-steps mode's screens), on the arrays read here,
    so it costs no request; it may raise Rejected. ``contents`` False: no chunk is read, the
    entry's ``norm`` is None, and its contents are checked after CLOSE (``check_contents``, or
    by volunteer aggregators part by part: checks/exchange.py)."""
    try:
        m = Manifest.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise Rejected(f"malformed manifest: {str(exc).splitlines()[0]}") from exc
    fmt = run.grad_format
    _, peer, part = run.keys.shard_parts(key)
    expect = {"layout_version": LAYOUT_VERSION, "run": run.name, "round": r, "peer": peer,
              "part": part, "codec": fmt.codec, "n": fmt.n, "chunk_size": fmt.chunk_size,
              "block": fmt.block}
    for field, want in expect.items():
        if getattr(m, field) != want:
            raise Rejected(f"manifest {field}={getattr(m, field)!r}, expected {want!r}")
    for name, (_, _, _) in fmt.arrays().items():
        if len(m.checksums.get(name, [])) != fmt.n_chunks:
            raise Rejected(f"manifest lists {len(m.checksums.get(name, []))} chunks of {name}")
    if run.config.organizer_key is not None:
        _check_signature(m, roster)
    if m.data.stream != m.peer:
        raise Rejected(f"data of stream {m.data.stream!r}: a volunteer counts only its own stream")
    try:
        return _admit(run, r, key, raw, m, stored, state_hash, stream_end, inspect, contents)
    except Rejected as exc:  # the manifest is its peer's own: its samples are spent either way
        raise Rejected(str(exc), data=m.data) from exc


def _admit(run: Run, r: int, key: str, raw: bytes, m: Manifest, stored: dict[str, int] | None,
           state_hash: str | None, stream_end: int | None, inspect, contents: bool) -> Entry:
    fmt = run.grad_format
    if m.state_hash != (state_hash or commit_hash(run.commit_of(r))):
        raise Rejected(f"computed on another state than round {r}'s (state_hash {m.state_hash[:12]}...)")
    if not math.isfinite(m.loss) or m.loss < 0:  # a cross-entropy is never negative
        raise Rejected(f"impossible loss {m.loss}")
    if sum(c for _, c in m.data.ranges) != m.samples:
        raise Rejected("data ranges do not add up to the sample count")
    _check_inner_steps(run, m)
    if m.samples > max_claim(run):
        raise Rejected(f"claims {m.samples} samples, more than a shard can hold ({max_claim(run)})")
    if stream_end is None:
        stream_end = int(run.stream_ends(r).get(m.peer, 0))
    _check_contiguous(m.data, stream_end, stream_window(run))
    if stored is None:
        stored = {k.removeprefix(key + "/"): n for k, n in run.bucket.sizes(key).items()}
    missing = sorted(vector.chunk_objects(fmt) - set(stored))
    if missing:  # zarr would read them as zeros: a shard of no data that checksums could still match
        raise Rejected(f"missing chunk objects: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    stored = sum(stored.values())
    if stored > stored_limit(fmt):
        raise Rejected(f"shard holds {stored} bytes, more than its format takes ({stored_limit(fmt)})")
    frozen = freeze(run, key)
    arrays, norm = check_contents(run, frozen, m.checksums) if contents else (None, None)
    entry = Entry(key=key, peer=m.peer, part=m.part, round=r, samples=m.samples, loss=m.loss,
                  stale_samples=m.stale_samples, inner_steps=m.inner_steps, precision=m.precision,
                  checksums=m.checksums, data=m.data, norm=norm,
                  manifest_sha=hashlib.sha256(raw).hexdigest())
    if inspect is not None:
        inspect(entry, arrays)
    return entry


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
        raise Rejected("non-finite gradient values")
    norm = math.sqrt(codec.squared_norm(arrays, fmt.codec, fmt.block))
    if norm > run.config.max_grad_norm:
        raise Rejected(f"gradient norm {norm:.3g} above the bound {run.config.max_grad_norm:.3g}")
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


def _check_signature(m: Manifest, roster: identity.Roster | None) -> None:
    if m.signature is None:
        raise Rejected("unsigned shard in a run that requires signatures")
    if roster is None:
        raise Rejected("no roster signed by the organizer: nobody is enrolled yet")
    try:
        key = roster.key_of(m.peer)
    except identity.IdentityError as exc:
        raise Rejected(str(exc)) from exc
    if not identity.verify(key, m.payload(), m.signature):
        raise Rejected(f"signature does not match {m.peer.split('.', 1)[0]!r}'s enrolled key")
