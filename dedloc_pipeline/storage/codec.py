"""Codecs for flat float32 vectors (gradient shards, parameter deltas) and their zarr storage.

``none`` stores fp32 (exact), ``fp16`` halves, ``int8`` and ``int4`` keep one absmax scale per
block of ``block`` elements and 127 or 7 levels each side of zero. ``sparse`` (SparseLoCo's
shape, for diloco's outer updates) keeps the largest 1/64 of each block by magnitude: their
positions in the block (uint16) and 2 bits each, a sign and one of two magnitudes the block
stores (the means of the smaller and the larger half), about 0.036 bytes per element before lz4;
what it drops, error feedback carries to the next vector. Every vector is stored as zarr
arrays chunked like the flat parameter vector, compressed with Blosc-lz4, so aggregators can read
any chunk range on its own. A vector one writer makes at once (a peer's gradient shard) keeps its
chunks in one object per array (zarr's sharding codec): a request per array, not per chunk, to
write it and to read it whole. Vectors that aggregators write in chunk ranges (parameters, state,
deltas) keep an object per chunk. Each chunk's decoded bytes are hashed into the manifest, so a
corrupted or forged chunk is caught on read.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np
import zarr
import zarr.core.sync
from zarr.codecs import BloscCodec
from zarr.errors import ContainsArrayError
from zarr.storage import StorePath

from .bucket import Bucket

FP16_MAX = float(np.finfo(np.float16).max)
LEVELS = {"int8": 127, "int4": 7}  # blockwise codes: integers in [-L, L]
SPARSE_KEEP = 64  # sparse: one element in this many of each block is kept
# Quantized codes are stored zigzag-folded (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) as uint8, so
# the bit planes above a block's typical magnitude are all zero and bit-shuffle + lz4 drops them.
# Measured on real tiny-ALBERT gradient codes (bytes per element): two's complement 0.71,
# zigzag 0.61; int4 parameter deltas 0.39 (lz4) and 0.35 (lz4hc); the fp32 scales prefer
# byte-shuffle (0.91 vs 1.01).
_SHUFFLE = {"scales": "shuffle"}


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

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_size)

    @property
    def per_object(self) -> int:
        """Chunks an array keeps in one object: all of them if written whole, else 0 (one each)."""
        return self.n_chunks if self.whole else 0

    def arrays(self) -> dict[str, tuple[str, int, int]]:
        """name -> (dtype, length, chunk length)."""
        if self.codec == "none":
            return {"values": ("float32", self.n, self.chunk_size)}
        if self.codec == "fp16":
            return {"values": ("float16", self.n, self.chunk_size)}
        nb = -(-self.n // self.block)
        if self.codec == "sparse":
            k, per_chunk = self.block // SPARSE_KEEP, self.chunk_size // self.block
            return {"indices": ("uint16", nb * k, per_chunk * k), "codes": ("uint8", nb * k // 4, per_chunk * k // 4),
                    "scales": ("float32", nb * 2, per_chunk * 2)}
        return {"codes": ("uint8", self.n, self.chunk_size),
                "scales": ("float32", nb, self.chunk_size // self.block)}

    def bounds(self, name: str, chunks: range) -> tuple[int, int]:
        _, length, clen = self.arrays()[name]
        return chunks.start * clen, min(chunks.stop * clen, length)

    def elements(self, chunks: range) -> int:
        """How many elements of the vector ``chunks`` hold."""
        return min(chunks.stop * self.chunk_size, self.n) - chunks.start * self.chunk_size


def encode(x: np.ndarray, codec: str, block: int) -> dict[str, np.ndarray]:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if codec == "none":
        return {"values": x.copy()}
    if codec == "fp16":
        return {"values": np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)}
    if codec == "sparse":
        return _sparse_encode(x, block)
    if codec not in LEVELS:
        raise ValueError(f"unknown codec {codec!r}")
    levels = LEVELS[codec]
    nb = -(-len(x) // block)
    padded = np.zeros(nb * block, np.float32)
    padded[: len(x)] = x
    blocks = padded.reshape(nb, block)
    scales = (np.abs(blocks).max(axis=1) / np.float32(levels)).astype(np.float32)
    q = np.zeros_like(blocks)
    np.divide(blocks, scales[:, None], out=q, where=scales[:, None] > 0)
    codes = np.clip(np.rint(q), -levels, levels).astype(np.int8).reshape(-1)[: len(x)]
    return {"codes": _zigzag(codes), "scales": scales}


def _sparse_encode(x: np.ndarray, block: int) -> dict[str, np.ndarray]:
    k, nb = block // SPARSE_KEEP, -(-len(x) // block)
    mag = np.full(nb * block, -1.0, np.float32)  # the padding of a short last block is kept last
    mag[: len(x)] = np.abs(x)
    idx = np.sort(np.argpartition(mag.reshape(nb, block), block - k, axis=1)[:, block - k:], axis=1)
    padded = np.zeros(nb * block, np.float32)
    padded[: len(x)] = x
    vals = np.take_along_axis(padded.reshape(nb, block), idx, axis=1)
    a = np.abs(vals)
    ranked = np.sort(a, axis=1)
    scales = np.stack([ranked[:, : k // 2].mean(axis=1), ranked[:, k // 2:].mean(axis=1)], axis=1).astype(np.float32)
    q = (a >= scales.mean(axis=1, keepdims=True)).astype(np.uint8) | ((vals < 0).astype(np.uint8) << 1)
    q = q.reshape(nb, k // 4, 4)
    codes = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
    return {"indices": idx.astype(np.uint16).reshape(-1), "codes": codes.reshape(-1), "scales": scales.reshape(-1)}


def _sparse_decode(arrays: dict[str, np.ndarray], block: int) -> np.ndarray:
    """Every block in full (a short last block's padding included: callers cut to length)."""
    pos, vals = _sparse_entries(arrays, block)
    out = np.zeros(len(arrays["scales"]) // 2 * block, np.float32)
    out[pos] = vals
    return out


def _sparse_entries(arrays: dict[str, np.ndarray], block: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the arrays' range, values) of the kept elements; a position outside its
    block is an error, never a write elsewhere."""
    idx, codes, scales = arrays["indices"], arrays["codes"], arrays["scales"]
    nb, k = len(scales) // 2, block // SPARSE_KEEP
    if len(idx) != nb * k or len(codes) * 4 != nb * k or len(scales) != 2 * nb:
        raise ValueError(f"sparse arrays of {len(idx)}, {len(codes)} and {len(scales)} elements disagree")
    if nb and int(idx.max()) >= block:
        raise ValueError(f"a sparse position {int(idx.max())} outside its block of {block}")
    q = ((codes[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(nb, k)
    sc = scales.reshape(nb, 2)
    vals = np.where(q & 1, sc[:, 1:], sc[:, :1])
    vals = np.where(q & 2, -vals, vals).astype(np.float32)
    return (np.arange(nb)[:, None] * block + idx.astype(np.int64).reshape(nb, k)).reshape(-1), vals.reshape(-1)


def _zigzag(codes: np.ndarray) -> np.ndarray:
    return (codes.view(np.uint8) << 1) ^ (codes >> 7).view(np.uint8)


def _levels(z: np.ndarray) -> np.ndarray:
    """Stored (zigzag-folded) codes back to their signed levels, as float32."""
    return ((z >> 1).view(np.int8) ^ -(z & 1).view(np.int8)).astype(np.float32)


def _per_block(values: np.ndarray, factors: np.ndarray, block: int) -> np.ndarray:
    """Multiply each block of ``values`` in place by its factor (the last block may be short)."""
    full = len(values) // block
    values[: full * block].reshape(full, block)[:] *= factors[:full, None]
    if full < len(factors) and full * block < len(values):
        values[full * block:] *= factors[full]
    return values


def decode(arrays: dict[str, np.ndarray], codec: str, block: int, n: int | None = None) -> np.ndarray:
    """Exact inverse of the codec's rounding: deterministic, so every peer gets the same bits.
    ``n``: the elements the arrays hold (needed by ``sparse``, whose blocks are stored whole)."""
    if codec in ("none", "fp16"):
        return arrays["values"].astype(np.float32)
    if codec == "sparse":
        return _sparse_decode(arrays, block)[:n]
    return _per_block(_levels(arrays["codes"]), arrays["scales"], block)


def accumulate(total: np.ndarray, arrays: dict[str, np.ndarray], codec: str, block: int,
               weight: float) -> None:
    """``total += weight * decode(arrays)`` in float64, in as few passes over memory as it takes."""
    if codec in ("none", "fp16"):
        total += arrays["values"].astype(np.float64) * weight
        return
    if codec == "sparse":  # only the kept positions: an aggregator's work per shard is 1/64 of a dense one's
        pos, vals = _sparse_entries(arrays, block)
        inside = pos < len(total)
        total[pos[inside]] += vals[inside].astype(np.float64) * weight
        return
    total += _per_block(_levels(arrays["codes"]), arrays["scales"] * np.float32(weight), block)


def squared_norm(arrays: dict[str, np.ndarray], codec: str, block: int) -> float:
    """||decode(arrays)||², for quantized codes straight from levels and scales (no decoding)."""
    if codec in ("none", "fp16"):
        v = arrays["values"].astype(np.float64)
        return float(v @ v)
    if codec == "sparse":  # from the kept entries (a short last block's padding among them)
        v = _sparse_entries(arrays, block)[1].astype(np.float64)
        return float(v @ v)
    scales = arrays["scales"].astype(np.float64)
    levels = _levels(arrays["codes"])
    full = len(levels) // block
    sums = np.einsum("ij,ij->i", *[levels[: full * block].reshape(full, block)] * 2)
    tail = levels[full * block:]
    return float(sums @ scales[:full] ** 2 + (tail @ tail) * (scales[full] ** 2 if len(tail) else 0.0))


class ErrorFeedback:
    """Keeps what a lossy codec dropped and adds it to the next vector (EF-SGD)."""

    def __init__(self, codec: str, block: int, residual: np.ndarray | None = None):
        self.codec, self.block, self.residual = codec, block, residual

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        if self.codec == "none":
            return encode(x, "none", self.block)
        y = x if self.residual is None else x + self.residual
        arrays = encode(y, self.codec, self.block)
        self.residual = y - decode(arrays, self.codec, self.block, len(y))
        return arrays


def delta_encode(p_old: np.ndarray, p_new: np.ndarray, codec: str, block: int,
                 residual: np.ndarray | None) -> tuple[dict, np.ndarray, np.ndarray | None]:
    """Compress a parameter update for download: (arrays, committed params, new residual).

    ``none`` stores the XOR of the float32 bit patterns: exact, and the unchanged sign and
    exponent bits compress. Lossy codecs quantize the difference (with error feedback), and the
    committed parameters are what a peer rebuilds from it, bit for bit.
    """
    if codec == "none":
        xor = p_old.view(np.uint32) ^ p_new.view(np.uint32)
        return {"values": xor.view(np.float32)}, p_new.copy(), None
    fb = ErrorFeedback(codec, block, residual)
    arrays = fb.encode(p_new - p_old)
    return arrays, delta_apply(p_old, arrays, codec, block), fb.residual


def delta_apply(p_old: np.ndarray, arrays: dict, codec: str, block: int) -> np.ndarray:
    if codec == "none":
        return (p_old.view(np.uint32) ^ arrays["values"].view(np.uint32)).view(np.float32)
    return p_old + decode(arrays, codec, block, len(p_old))


def checksum(a: np.ndarray) -> str:
    """SHA-256 (128 bits kept): hardware-accelerated on x86 and ARM, twice blake2b's speed here."""
    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()[:32]


def chunk_checksums(fmt: VectorFormat, arrays: dict[str, np.ndarray], chunks: range) -> dict[str, list[str]]:
    """Hashes of each chunk of each array; ``arrays`` hold exactly the elements of ``chunks``."""
    out = {}
    for name, (_, _, clen) in fmt.arrays().items():
        a = arrays[name]
        out[name] = [checksum(a[i * clen:(i + 1) * clen]) for i in range(len(chunks))]
    return out


def create_vector(bucket: Bucket, key: str, fmt: VectorFormat, cname: str = "lz4") -> dict:
    """Array metadata only; an existing array (a restarted writer) is left as it is. Returns
    the arrays it created, open for writing (no second request to open them).

    ``lz4hc`` writes the same lz4 format, smaller and far slower to make: worth it for what one
    writer makes and every peer downloads (parameter deltas), not for each peer's shard.
    """
    created = {}
    for name, (dtype, length, clen) in fmt.arrays().items():
        try:
            created[name] = zarr.create_array(
                bucket.zarr_store(f"{key}/{name}"), shape=(length,), dtype=dtype, fill_value=0, zarr_format=3,
                overwrite=False, **_layout(name, clen, fmt.per_object, cname))
        except ContainsArrayError:
            pass
    return created


def _layout(name: str, clen: int, whole: int, cname: str = "lz4") -> dict:
    """Chunking and compression of an array: ``whole`` chunks in one object, or (0) an object each."""
    compressor = BoundedBlosc(cname=cname, clevel=9, shuffle=_SHUFFLE.get(name, "bitshuffle"))
    if whole:
        return {"chunks": (clen,), "shards": (whole * clen,), "compressors": compressor}
    return {"chunks": (clen,), "compressors": compressor}


def chunk_objects(fmt: VectorFormat) -> set[str]:
    """The chunk objects a whole vector stores, by name under its key (zarr's ``c/`` keys)."""
    per_array = 1 if fmt.whole else fmt.n_chunks
    return {f"{name}/c/{i}" for name in fmt.arrays() for i in range(per_array)}


def _write_whole(bucket: Bucket, key: str, fmt: VectorFormat, arrays: dict[str, np.ndarray]) -> None:
    """A whole vector as one metadata and one data object per array, nothing read first: a
    shard's key is new (its part name is unique), so there is nothing to keep. zarr encodes
    each array in memory (it reads a shard before writing one), and its objects are put as they
    are; chunks of zeros are stored too, so an honest shard has every object (chunk_objects)."""
    objects = {}
    for name, (dtype, length, clen) in fmt.arrays().items():
        objects[name] = {}
        z = zarr.create_array(zarr.storage.MemoryStore(objects[name]), shape=(length,), dtype=dtype, fill_value=0,
                              zarr_format=3, config={"write_empty_chunks": True}, **_layout(name, clen, fmt.per_object))
        z[:] = arrays[name]

    async def put():
        for name, encoded in objects.items():
            store = bucket.zarr_store(f"{key}/{name}")
            for file, buf in encoded.items():
                await store.set(file, buf)

    zarr.core.sync.sync(put())


def write_vector(bucket: Bucket, key: str, fmt: VectorFormat, arrays: dict[str, np.ndarray],
                 chunks: range | None = None) -> dict[str, list[str]]:
    """Write ``arrays`` (the elements of ``chunks``, default all) and return their chunk hashes."""
    chunks = chunks or range(fmt.n_chunks)
    complete = chunks.start == 0 and chunks.stop == fmt.n_chunks
    if fmt.whole:
        if not complete:
            raise ValueError(f"{key}: a whole vector is written at once, not chunks {chunks}")
        for name, (_, length, _) in fmt.arrays().items():
            if len(arrays[name]) != length:
                raise ValueError(f"{key}/{name}: {len(arrays[name])} elements for {length}")
        _write_whole(bucket, key, fmt, arrays)
        return chunk_checksums(fmt, arrays, chunks)
    created = create_vector(bucket, key, fmt) if complete else {}
    for name in fmt.arrays():
        lo, hi = fmt.bounds(name, chunks)
        if len(arrays[name]) != hi - lo:
            raise ValueError(f"{key}/{name}: {len(arrays[name])} elements for [{lo}, {hi})")
        z = created.get(name) or zarr.open_array(bucket.zarr_store(f"{key}/{name}"), mode="r+", zarr_format=3)
        z[lo:hi] = arrays[name]
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
    event loop (a remote bucket's latency overlaps); a vector that is missing, malformed or does
    not match its checksums comes back as its CorruptShard instead."""
    chunks = chunks or range(fmt.n_chunks)
    checksums = checksums or [None] * len(keys)
    implied = {name: _metadata(*spec, name=name, whole=fmt.per_object) for name, spec in fmt.arrays().items()}

    async def gather():
        return await asyncio.gather(*(_read(bucket, k, fmt, chunks, implied if s is not None else None)
                                      for k, s in zip(keys, checksums)), return_exceptions=True)

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


async def _read(bucket: Bucket, key: str, fmt: VectorFormat, chunks: range,
                implied: dict | None) -> dict[str, np.ndarray]:
    """With ``implied`` metadata the arrays are not opened (one request less per array); only for
    checksummed reads, where any stored array that does not match, missing chunks included,
    fails its checksums."""
    arrays = {}
    for name, (dtype, length, _) in fmt.arrays().items():
        store = bucket.zarr_store(f"{key}/{name}")
        if implied is not None:
            z = zarr.AsyncArray(metadata=implied[name], store_path=StorePath(store))
        else:
            try:
                z = await zarr.api.asynchronous.open_array(store=store, mode="r", zarr_format=3)
            except (FileNotFoundError, zarr.errors.ArrayNotFoundError) as exc:
                raise CorruptShard(f"{key}/{name}: missing array") from exc
            if z.dtype != np.dtype(dtype) or z.shape != (length,):
                raise CorruptShard(f"{key}/{name}: {z.dtype}{z.shape}, expected {dtype}")
        lo, hi = fmt.bounds(name, chunks)
        try:
            arrays[name] = await z.getitem(slice(lo, hi))
        except (RuntimeError, ValueError, TypeError) as exc:  # bytes that do not decompress
            raise CorruptShard(f"{key}/{name}: undecodable chunk ({exc})") from exc
    return arrays


@functools.lru_cache(maxsize=64)
def _metadata(dtype: str, length: int, clen: int, name: str = "values", whole: int = 0):
    """What create_vector writes for such an array (a reader need not match the compressor's
    settings: a Blosc frame describes itself)."""
    z = zarr.create_array(zarr.storage.MemoryStore(), shape=(length,), dtype=dtype, fill_value=0,
                          zarr_format=3, **_layout(name, clen, whole))
    return z.metadata
