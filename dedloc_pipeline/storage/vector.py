"""Flat vectors in the bucket as zarr arrays: what a codec's arrays (``codec``) become as
objects, and back, checked.

Every vector is stored as zarr arrays chunked like the flat parameter vector, compressed with
Blosc-lz4, so aggregators can read any chunk range on its own. Its arrays' metadata is the run's
(``_metadata``: every vector of a kind has the same shape, dtype and layout), so a vector is its
chunk objects alone, written and read with that metadata and never a ``zarr.json`` (a request
less per array to make, open or find one). A vector one writer makes at once (a peer's gradient
shard) keeps its chunks in one object per array (zarr's sharding codec), and codes and scales in
one array of bytes (``VectorFormat.packed``): one request, not one per chunk and array, to write
it, to copy it and to read it whole. Vectors that aggregators write in chunk ranges
(parameters, state, deltas) keep an object per chunk; a chunk of zeros is not stored there (it
reads as zeros), so what proves such a vector whole is its COMMIT's checksums, and the markers
and COMMIT written after it prove it written. Each chunk's decoded bytes are hashed into the
manifest, so a corrupted or forged chunk is caught on read.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zarr
import zarr.core.sync
from zarr.codecs import BloscCodec
from zarr.storage import StorePath

from .bucket import Bucket, StorageError
from .codec import codec_of, decode

# Every array is bit-shuffled before lz4 (zigzag-folded codes lose their empty high bit planes,
# see codec), but for the fp32 scales, which prefer byte-shuffle (0.91 vs 1.01 bytes per element
# on real tiny-ALBERT gradients). int4 parameter deltas take 0.39 bytes (lz4) and 0.35 (lz4hc).
_SHUFFLE = {"scales": "shuffle"}
PACKED = "shard"  # the one stored array of a packed vector (VectorFormat.packed): codes, then scales, per chunk


class CorruptShard(ValueError):
    """Stored bytes do not match what the manifest promised."""


class BoundedBlosc(BloscCodec):
    """Blosc that reads a frame's 16-byte header before decoding it: a frame must decode to
    exactly its chunk's bytes and be as long as it says. A few kilobytes stored can otherwise
    claim gigabytes decoded (a Blosc bomb), and Blosc allocates what the header claims first.
    zarr uses it for every array this package opens (the ``blosc`` codec's implementation)."""

    def _decode_sync(self, chunk_bytes, chunk_spec):
        raw = chunk_bytes.as_numpy_array()
        want = math.prod(chunk_spec.shape) * chunk_spec.dtype.to_native_dtype().itemsize
        if raw.nbytes < 16:
            raise ValueError(f"a Blosc frame of {raw.nbytes} bytes, shorter than its header")
        nbytes, _, cbytes = struct.unpack_from("<3I", raw, 4)
        if nbytes != want or cbytes != raw.nbytes:
            raise ValueError(f"a Blosc frame of {raw.nbytes} bytes claims {cbytes} stored and {nbytes} "
                             f"decoded; its chunk holds {want}")
        return super()._decode_sync(chunk_bytes, chunk_spec)


zarr.registry.register_codec("blosc", BoundedBlosc)
zarr.config.set({"codecs.blosc": f"{BoundedBlosc.__module__}.{BoundedBlosc.__qualname__}"})


@dataclass(frozen=True)
class VectorFormat:
    """How one flat vector of ``n`` elements is encoded and chunked."""

    codec: str
    n: int
    chunk_size: int
    block: int
    whole: bool = False  # written at once by one writer: one object per array
    # lz4hc writes the same lz4 format, smaller and far slower to make: worth it for what one
    # writer makes and every peer downloads (parameter deltas), not for each peer's shard
    cname: str = "lz4"

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_size)

    @property
    def per_object(self) -> int:
        """Chunks an array keeps in one object: all of them if written whole, else 0 (one each)."""
        return self.n_chunks if self.whole else 0

    def arrays(self) -> dict[str, tuple[str, int, int]]:
        """The codec's arrays: name -> (dtype, length, chunk length)."""
        return codec_of(self.codec).arrays(self.n, self.chunk_size, self.block)

    @property
    def packed(self) -> bool:
        """Written whole with codes and scales (``Blockwise``): all its arrays in one object."""
        return self.whole and set(self.arrays()) == {"codes", "scales"}

    def stored(self) -> dict[str, tuple[str, int, int]]:
        """The arrays as stored: the codec's, or for a packed vector one array of bytes
        (``PACKED``) whose chunk c holds chunk c of each of the codec's arrays, back to back: a
        shard is then one object to upload, to copy when frozen, and to read."""
        if not self.packed:
            return self.arrays()
        width = sum(np.dtype(dtype).itemsize * clen for dtype, _, clen in self.arrays().values())
        return {PACKED: ("uint8", self.n_chunks * width, width)}

    def bounds(self, name: str, chunks: range) -> tuple[int, int]:
        """Elements of array ``name`` (the codec's or a stored one) that ``chunks`` hold."""
        _, length, clen = {**self.arrays(), **self.stored()}[name]
        return chunks.start * clen, min(chunks.stop * clen, length)

    def elements(self, chunks: range) -> int:
        """How many elements of the vector ``chunks`` hold."""
        return min(chunks.stop * self.chunk_size, self.n) - chunks.start * self.chunk_size


def checksum(a: np.ndarray) -> str:
    """SHA-256 (128 bits kept): hardware-accelerated on x86 and ARM, twice blake2b's speed here."""
    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()[:32]


KEEP_BYTES = 1 << 30  # what the organizer holds of the state it wrote (``Kept``); a larger state is read back


class Kept:
    """Vectors this process wrote, by key and part, with their chunk checksums: the organizer
    steps from the gradient and the state it wrote instead of reading them back (issue 50: the
    reads were a fifth of its CPU a round on loopback). Each is taken once (a step changes its
    arrays in place), only where the record written after it still names the same checksums (a
    part another process rewrote is read), and at most ``limit_bytes`` are held, the newest
    (a large model's state is read back)."""

    def __init__(self, limit_bytes: int = KEEP_BYTES):
        self.limit_bytes = limit_bytes
        self._held: dict[tuple[str, int], tuple[dict, dict]] = {}  # oldest first
        self._lock = threading.Lock()  # parts are computed on a pool's threads

    def put(self, key: str, part: int, vectors: dict[str, dict[str, np.ndarray]], sums: dict) -> None:
        """Hold ``vectors`` (by name, each its arrays) written at ``key`` for ``part``; ``sums``:
        their checksums as the record after them names them."""
        size = lambda entry: sum(a.nbytes for v in entry[0].values() for a in v.values())  # noqa: E731
        with self._lock:
            self._held.pop((key, part), None)
            self._held[(key, part)] = (vectors, sums)
            while sum(map(size, self._held.values())) > self.limit_bytes:
                del self._held[next(iter(self._held))]

    def take(self, key: str, part: int, record: Callable[[], dict | None]) -> dict[str, dict[str, np.ndarray]] | None:
        """What ``put`` held for ``key`` and ``part``, if the checksums its record names now
        (``record()``, asked only then; None: no record) are those it was held with; it is held
        no more either way."""
        with self._lock:
            held = self._held.pop((key, part), None)
        return held[0] if held is not None and held[1] == record() else None


def chunk_checksums(fmt: VectorFormat, arrays: dict[str, np.ndarray], chunks: range) -> dict[str, list[str]]:
    """Hashes of each chunk of each array; ``arrays`` hold exactly the elements of ``chunks``."""
    out = {}
    for name, (_, _, clen) in fmt.arrays().items():
        a = arrays[name]
        out[name] = [checksum(a[i * clen:(i + 1) * clen]) for i in range(len(chunks))]
    return out


def _layout(name: str, clen: int, whole: int, cname: str = "lz4") -> dict:
    """Chunking and compression of an array: ``whole`` chunks in one object, or (0) an object each."""
    compressor = BoundedBlosc(cname=cname, clevel=9, shuffle=_SHUFFLE.get(name, "bitshuffle"))
    if whole:
        return {"chunks": (clen,), "shards": (whole * clen,), "compressors": compressor}
    return {"chunks": (clen,), "compressors": compressor}


def chunk_object(fmt: VectorFormat, name: str, chunk: int) -> str:
    """The object holding chunk ``chunk`` of array ``name``, by name under the vector's key
    (zarr's ``c/`` keys; a vector written whole keeps all its chunks in one)."""
    return f"{name}/c/{0 if fmt.whole else chunk}"


def chunk_objects(fmt: VectorFormat) -> set[str]:
    """The chunk objects a whole vector stores, by name under its key."""
    return {chunk_object(fmt, name, i) for name in fmt.stored() for i in range(fmt.n_chunks)}


def _pack(fmt: VectorFormat, arrays: dict[str, np.ndarray], chunks: range) -> dict[str, np.ndarray]:
    """The stored arrays of ``arrays`` (the codec's, holding the elements of ``chunks``)."""
    if not fmt.packed:
        return arrays
    rows = np.zeros((len(chunks), fmt.stored()[PACKED][2]), np.uint8)
    col = 0
    for name, (dtype, _, clen) in fmt.arrays().items():
        size = np.dtype(dtype).itemsize * clen
        raw = np.zeros(len(chunks) * size, np.uint8)  # a short last chunk is padded with zeros
        data = np.ascontiguousarray(arrays[name], dtype=dtype).view(np.uint8)
        raw[:data.size] = data
        rows[:, col:col + size] = raw.reshape(len(chunks), size)
        col += size
    return {PACKED: rows.reshape(-1)}


def _unpack(fmt: VectorFormat, stored: dict[str, np.ndarray], chunks: range) -> dict[str, np.ndarray]:
    """The codec's arrays, the elements of ``chunks``, from the stored ones (``_pack``)."""
    if not fmt.packed:
        return stored
    rows = stored[PACKED].reshape(len(chunks), -1)
    out, col = {}, 0
    for name, (dtype, _, clen) in fmt.arrays().items():
        size = np.dtype(dtype).itemsize * clen
        lo, hi = fmt.bounds(name, chunks)
        out[name] = np.ascontiguousarray(rows[:, col:col + size]).reshape(-1).view(dtype)[:hi - lo]
        col += size
    return out


def _write_whole(bucket: Bucket, key: str, fmt: VectorFormat, arrays: dict[str, np.ndarray]) -> None:
    """A whole vector as one data object per array, nothing read first: a shard's key is new
    (its part name is unique), so there is nothing to keep. zarr encodes each array in memory
    (it reads a shard before writing one), and its chunk objects are put as they are; chunks of
    zeros are stored too, so an honest shard has every object (chunk_objects)."""
    objects = {}
    for name, values in _pack(fmt, arrays, range(fmt.n_chunks)).items():
        objects[name] = {}
        z = zarr.AsyncArray(metadata=_metadata(fmt, name), config={"write_empty_chunks": True},
                            store_path=StorePath(zarr.storage.MemoryStore(objects[name])))
        zarr.Array(z)[:] = values

    async def put():
        for name, encoded in objects.items():
            store = bucket.zarr_store(f"{key}/{name}")
            for file, buf in encoded.items():
                await store.set(file, buf)

    zarr.core.sync.sync(put())


def write_vector(bucket: Bucket, key: str, fmt: VectorFormat, arrays: dict[str, np.ndarray],
                 chunks: range | None = None) -> dict[str, list[str]]:
    """Write ``arrays`` (the elements of ``chunks``, default all) and return their chunk hashes;
    nothing is read first."""
    chunks = chunks or range(fmt.n_chunks)
    if fmt.whole:
        if chunks.start != 0 or chunks.stop != fmt.n_chunks:
            raise ValueError(f"{key}: a whole vector is written at once, not chunks {chunks}")
        for name, (_, length, _) in fmt.arrays().items():
            if len(arrays[name]) != length:
                raise ValueError(f"{key}/{name}: {len(arrays[name])} elements for {length}")
        _write_whole(bucket, key, fmt, arrays)
        return chunk_checksums(fmt, arrays, chunks)
    for name in fmt.arrays():
        lo, hi = fmt.bounds(name, chunks)
        if len(arrays[name]) != hi - lo:
            raise ValueError(f"{key}/{name}: {len(arrays[name])} elements for [{lo}, {hi})")
        zarr.Array(_array(bucket, key, name, _metadata(fmt, name)))[lo:hi] = arrays[name]
    return chunk_checksums(fmt, arrays, chunks)


def read_vector(bucket: Bucket, key: str, fmt: VectorFormat, chunks: range | None = None,
                checksums: dict[str, list[str]] | None = None, raw: bool = False):
    """Decoded float32 elements of ``chunks`` (or the raw arrays); checked against ``checksums``."""
    arrays = read_vectors(bucket, [key], fmt, chunks, [checksums])[0]
    if isinstance(arrays, CorruptShard):
        raise arrays
    return arrays if raw else decode(arrays, fmt.codec, fmt.block, fmt.elements(chunks or range(fmt.n_chunks)))


def read_vectors(bucket: Bucket, keys: list[str], fmt: VectorFormat, chunks: range | None = None,
                 checksums: list[dict[str, list[str]] | None] | None = None) -> list[dict | CorruptShard]:
    """The raw arrays of ``chunks`` of many vectors, all requests in flight at once on zarr's
    event loop (a remote bucket's latency overlaps); a vector that is malformed or does not match
    its checksums (missing chunks included) comes back as its CorruptShard instead."""
    chunks = chunks or range(fmt.n_chunks)
    checksums = checksums or [None] * len(keys)
    metadata = {name: _metadata(fmt, name) for name in fmt.stored()}  # made here: zarr's loop cannot

    async def gather():
        return await asyncio.gather(*(_read(bucket, k, fmt, chunks, metadata) for k in keys), return_exceptions=True)

    found = zarr.core.sync.sync(gather())
    for i, (key, arrays, sums) in enumerate(zip(keys, found, checksums)):
        if isinstance(arrays, BaseException) and not isinstance(arrays, CorruptShard):
            raise arrays
        if sums is not None and not isinstance(arrays, CorruptShard):
            for name, got in chunk_checksums(fmt, arrays, chunks).items():
                if got != sums.get(name, [])[chunks.start:chunks.stop]:
                    found[i] = CorruptShard(f"{key}/{name}: chunk checksum mismatch")
                    break
    return found


async def _read(bucket: Bucket, key: str, fmt: VectorFormat, chunks: range, metadata: dict) -> dict[str, np.ndarray]:
    arrays = {}
    for name in fmt.stored():
        z = _array(bucket, key, name, metadata[name])
        lo, hi = fmt.bounds(name, chunks)
        try:
            arrays[name] = await z.getitem(slice(lo, hi))
        except StorageError:  # a RuntimeError too, but the bucket's fault, not the bytes'
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # bytes that do not decompress
            raise CorruptShard(f"{key}/{name}: undecodable chunk ({exc})") from exc
    return _unpack(fmt, arrays, chunks)


def _array(bucket: Bucket, key: str, name: str, metadata) -> zarr.AsyncArray:
    """Array ``name`` of vector ``key``, opened with the run's metadata (``_metadata``): no request."""
    return zarr.AsyncArray(metadata=metadata, store_path=StorePath(bucket.zarr_store(f"{key}/{name}")))


@functools.lru_cache(maxsize=64)
def _metadata(fmt: VectorFormat, name: str):
    """The metadata of array ``name`` of a vector of format ``fmt``: a ``zarr.json`` never stored
    (a reader need not match the compressor's settings: a Blosc frame describes itself)."""
    dtype, length, clen = fmt.stored()[name]
    z = zarr.create_array(zarr.storage.MemoryStore(), shape=(length,), dtype=dtype, fill_value=0,
                          zarr_format=3, **_layout(name, clen, fmt.per_object, fmt.cname))
    return z.metadata
