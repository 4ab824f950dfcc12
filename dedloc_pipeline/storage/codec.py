"""Codecs for flat float32 vectors (gradient shards, parameter deltas), one class each in one
registry (``CODECS``, ``codec_of``): the arrays a codec stores a vector as, and what an aggregator
computes on them (decode, a weighted sum, a norm).

``none`` stores fp32 (exact), ``fp16`` halves, ``int8`` and ``int4`` keep one absmax scale per
block of ``block`` elements and 127 or 7 levels each side of zero. ``sparse`` (SparseLoCo's
shape, for diloco's outer updates) keeps the largest 1/64 of each block by magnitude: their
positions in the block (uint16) and 2 bits each, a sign and one of two magnitudes the block
stores (the means of the smaller and the larger half), about 0.036 bytes per element before lz4;
what it drops, error feedback carries to the next vector. How the arrays are chunked, compressed
and checked in the bucket is ``vector``'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

FP16_MAX = float(np.finfo(np.float16).max)
SPARSE_KEEP = 64  # sparse: one element in this many of each block is kept

Arrays = dict[str, np.ndarray]


class Codec(ABC):
    """One way to store a flat float32 vector. ``exact`` codecs drop nothing: no error feedback,
    and a parameter delta can be the XOR of the fp32 bit patterns they store as ``values``."""

    name: str
    exact = False

    @abstractmethod
    def arrays(self, n: int, chunk_size: int, block: int) -> dict[str, tuple[str, int, int]]:
        """name -> (dtype, length, chunk length) of what a vector of ``n`` elements is stored as."""

    def encode(self, x: np.ndarray, block: int) -> Arrays:
        return self._encode(np.ascontiguousarray(x, dtype=np.float32), block)

    @abstractmethod
    def _encode(self, x: np.ndarray, block: int) -> Arrays:
        """The arrays for ``x``, already contiguous float32."""

    @abstractmethod
    def decode(self, arrays: Arrays, block: int, n: int | None = None) -> np.ndarray:
        """Exact inverse of the codec's rounding: deterministic, so every peer gets the same bits.
        ``n``: the elements the arrays hold (needed by ``sparse``, whose blocks are stored whole)."""

    @abstractmethod
    def accumulate(self, total: np.ndarray, arrays: Arrays, block: int, weight: float) -> None:
        """``total += weight * decode(arrays)`` in float64, in as few passes over memory as it takes."""

    @abstractmethod
    def squared_norm(self, arrays: Arrays, block: int) -> float:
        """||decode(arrays)||², without decoding where the codec allows."""


class _Dense(Codec):
    """Every element as a float of ``dtype``, in one ``values`` array."""

    dtype: str

    def arrays(self, n, chunk_size, block):
        return {"values": (self.dtype, n, chunk_size)}

    def decode(self, arrays, block, n=None):
        return arrays["values"].astype(np.float32)

    def accumulate(self, total, arrays, block, weight):
        total += arrays["values"].astype(np.float64) * weight

    def squared_norm(self, arrays, block):
        v = arrays["values"].astype(np.float64)
        return float(v @ v)


class Fp32(_Dense):
    name, dtype, exact = "none", "float32", True

    def _encode(self, x, block):
        return {"values": x.copy()}


class Fp16(_Dense):
    name, dtype = "fp16", "float16"

    def _encode(self, x, block):
        return {"values": np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)}


# Quantized codes are stored zigzag-folded (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) as uint8, so
# the bit planes above a block's typical magnitude are all zero and bit-shuffle + lz4 drops them.
# Measured on real tiny-ALBERT gradient codes (bytes per element): two's complement 0.71,
# zigzag 0.61.
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


class Blockwise(Codec):
    """Integer codes in [-levels, levels] (``codes``) and one absmax scale per block (``scales``)."""

    def __init__(self, name: str, levels: int):
        self.name, self.levels = name, levels

    def arrays(self, n, chunk_size, block):
        return {"codes": ("uint8", n, chunk_size), "scales": ("float32", -(-n // block), chunk_size // block)}

    def _encode(self, x, block):
        nb = -(-len(x) // block)
        padded = np.zeros(nb * block, np.float32)
        padded[: len(x)] = x
        blocks = padded.reshape(nb, block)
        scales = (np.abs(blocks).max(axis=1) / np.float32(self.levels)).astype(np.float32)
        q = np.zeros_like(blocks)
        np.divide(blocks, scales[:, None], out=q, where=scales[:, None] > 0)
        codes = np.clip(np.rint(q), -self.levels, self.levels).astype(np.int8).reshape(-1)[: len(x)]
        return {"codes": _zigzag(codes), "scales": scales}

    def decode(self, arrays, block, n=None):
        return _per_block(_levels(arrays["codes"]), arrays["scales"], block)

    def accumulate(self, total, arrays, block, weight):
        total += _per_block(_levels(arrays["codes"]), arrays["scales"] * np.float32(weight), block)

    def squared_norm(self, arrays, block):
        """Straight from levels and scales (no decoding)."""
        scales = arrays["scales"].astype(np.float64)
        levels = _levels(arrays["codes"])
        full = len(levels) // block
        sums = np.einsum("ij,ij->i", *[levels[: full * block].reshape(full, block)] * 2)
        tail = levels[full * block:]
        return float(sums @ scales[:full] ** 2 + (tail @ tail) * (scales[full] ** 2 if len(tail) else 0.0))


class Sparse(Codec):
    """The largest 1/SPARSE_KEEP of each block: ``indices`` in the block, 2-bit ``codes`` (four
    a byte) and two magnitudes per block (``scales``)."""

    name = "sparse"

    def arrays(self, n, chunk_size, block):
        nb, k, per_chunk = -(-n // block), block // SPARSE_KEEP, chunk_size // block
        return {"indices": ("uint16", nb * k, per_chunk * k), "codes": ("uint8", nb * k // 4, per_chunk * k // 4),
                "scales": ("float32", nb * 2, per_chunk * 2)}

    def _encode(self, x, block):
        k, nb = block // SPARSE_KEEP, -(-len(x) // block)
        # Which entries are kept must not depend on the machine: numpy's selection breaks ties
        # (zeros, say) differently with other vector units, so every key is made unique: a
        # magnitude's bits (a float >= 0 orders as its bits), then the earlier position; 0 for the
        # padding of a short last block, kept last.
        key = np.zeros(nb * block, np.uint64)
        key[: len(x)] = (np.abs(x).view(np.uint32).astype(np.uint64) + 1) << 16 | \
            (block - 1 - np.arange(len(x), dtype=np.uint64) % block)
        idx = np.sort(np.argpartition(key.reshape(nb, block), block - k, axis=1)[:, block - k:], axis=1)
        padded = np.zeros(nb * block, np.float32)
        padded[: len(x)] = x
        vals = np.take_along_axis(padded.reshape(nb, block), idx, axis=1)
        a = np.abs(vals)
        ranked = np.sort(a, axis=1)
        scales = np.stack([ranked[:, : k // 2].mean(axis=1), ranked[:, k // 2:].mean(axis=1)],
                          axis=1).astype(np.float32)
        q = (a >= scales.mean(axis=1, keepdims=True)).astype(np.uint8) | ((vals < 0).astype(np.uint8) << 1)
        q = q.reshape(nb, k // 4, 4)
        codes = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
        return {"indices": idx.astype(np.uint16).reshape(-1), "codes": codes.reshape(-1), "scales": scales.reshape(-1)}

    def decode(self, arrays, block, n=None):
        """Every block in full (a short last block's padding included), cut to ``n``."""
        pos, vals = self._entries(arrays, block)
        out = np.zeros(len(arrays["scales"]) // 2 * block, np.float32)
        out[pos] = vals
        return out[:n]

    def accumulate(self, total, arrays, block, weight):
        """Only the kept positions: an aggregator's work per shard is 1/64 of a dense one's."""
        pos, vals = self._entries(arrays, block)
        inside = pos < len(total)
        total[pos[inside]] += vals[inside].astype(np.float64) * weight

    def squared_norm(self, arrays, block):
        """From the kept entries (a short last block's padding among them)."""
        v = self._entries(arrays, block)[1].astype(np.float64)
        return float(v @ v)

    @staticmethod
    def _entries(arrays: Arrays, block: int) -> tuple[np.ndarray, np.ndarray]:
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


CODECS: dict[str, Codec] = {c.name: c for c in (
    Fp32(), Fp16(), Blockwise("int8", 127), Blockwise("int4", 7), Sparse())}


def codec_of(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}") from None


# The calls by codec name, as runs and manifests spell it.
def encode(x: np.ndarray, codec: str, block: int) -> Arrays:
    return codec_of(codec).encode(x, block)


def decode(arrays: Arrays, codec: str, block: int, n: int | None = None) -> np.ndarray:
    return codec_of(codec).decode(arrays, block, n)


def accumulate(total: np.ndarray, arrays: Arrays, codec: str, block: int, weight: float) -> None:
    codec_of(codec).accumulate(total, arrays, block, weight)


def squared_norm(arrays: Arrays, codec: str, block: int) -> float:
    return codec_of(codec).squared_norm(arrays, block)


class ErrorFeedback:
    """Keeps what a lossy codec dropped and adds it to the next vector (EF-SGD)."""

    def __init__(self, codec: str, block: int, residual: np.ndarray | None = None):
        self.codec, self.block, self.residual = codec, block, residual

    def encode(self, x: np.ndarray) -> Arrays:
        c = codec_of(self.codec)
        if c.exact:
            return c.encode(x, self.block)
        y = x if self.residual is None else x + self.residual
        arrays = c.encode(y, self.block)
        self.residual = y - c.decode(arrays, self.block, len(y))
        return arrays


def delta_encode(p_old: np.ndarray, p_new: np.ndarray, codec: str, block: int,
                 residual: np.ndarray | None) -> tuple[dict, np.ndarray, np.ndarray | None]:
    """Compress a parameter update for download: (arrays, committed params, new residual).

    An exact codec (``none``) stores the XOR of the float32 bit patterns: exact, and the
    unchanged sign and exponent bits compress. Lossy codecs quantize the difference (with error
    feedback), and the committed parameters are what a peer rebuilds from it, bit for bit.
    """
    if codec_of(codec).exact:
        xor = p_old.view(np.uint32) ^ p_new.view(np.uint32)
        return {"values": xor.view(np.float32)}, p_new.copy(), None
    fb = ErrorFeedback(codec, block, residual)
    arrays = fb.encode(p_new - p_old)
    return arrays, delta_apply(p_old, arrays, codec, block), fb.residual


def delta_apply(p_old: np.ndarray, arrays: dict, codec: str, block: int) -> np.ndarray:
    if codec_of(codec).exact:
        return (p_old.view(np.uint32) ^ arrays["values"].view(np.uint32)).view(np.float32)
    return p_old + decode(arrays, codec, block, len(p_old))
