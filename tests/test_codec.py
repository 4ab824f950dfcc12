"""Codec round trips, error feedback, chunked storage and the exact parameter delta."""

import typing

import numpy as np
import pytest

from dedloc_pipeline.protocol.config import Codec
from dedloc_pipeline.storage import codec, vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.vector import CorruptShard, VectorFormat


def _vec(n, seed=0, scale=1e-2):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def test_the_registry_holds_every_codec_a_run_accepts():
    """Each name RunConfig accepts is a class in the registry, named by it; any other is refused."""
    names = set(typing.get_args(Codec))
    assert names == set(codec.CODECS) == {"none", "fp16", "int8", "int4", "sparse"}
    assert all(codec.codec_of(n).name == n for n in names)
    with pytest.raises(ValueError, match="unknown codec"):
        codec.codec_of("int2")


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4"])
def test_round_trip_error_bounds(name):
    x = _vec(10_001)
    x[17] = 0.5  # an outlier block
    y = codec.decode(codec.encode(x, name, 256), name, 256)
    assert y.dtype == np.float32 and y.shape == x.shape
    err = np.abs(y - x)
    if name == "none":
        assert np.array_equal(y, x)
    elif name == "fp16":
        assert err.max() <= np.abs(x).max() * 2 ** -10
    else:  # half a quantization step of each block's absmax / levels
        blocks = np.abs(np.pad(x, (0, (-len(x)) % 256))).reshape(-1, 256).max(1)
        step = blocks / codec.codec_of(name).levels
        assert np.all(err <= np.repeat(step / 2, 256)[: len(x)] * (1 + 1e-6))
        assert np.abs(y).max() == pytest.approx(0.5)  # the extremes survive exactly


def test_quantized_codes_store_small_magnitudes_in_few_bytes(bucket):
    """Codes are stored zigzag-folded, so bit-shuffled lz4 drops the empty high bit planes of a
    heavy-tailed gradient: measured in bytes written to the bucket, not estimated."""
    n = 1 << 18
    x = (np.random.default_rng(3).standard_t(3, n) * 1e-3).astype(np.float32)
    written = {}
    for name in ("int8", "int4"):
        fmt = VectorFormat(name, n, 1 << 16, 4096)
        before = bucket.stats.bytes_written
        vector.write_vector(bucket, f"v-{name}", fmt, codec.encode(x, name, 4096))
        written[name] = (bucket.stats.bytes_written - before) / n
        assert np.array_equal(vector.read_vector(bucket, f"v-{name}", fmt),
                              codec.decode(codec.encode(x, name, 4096), name, 4096))
    assert written["int8"] < 0.8 and written["int4"] < 0.35, written


def test_int8_zero_block_and_fp16_overflow():
    x = np.zeros(1000, np.float32)
    arrays = codec.encode(x, "int8", 128)
    assert np.array_equal(codec.decode(arrays, "int8", 128), x)
    big = np.array([1e6, -1e6, 1.0], np.float32)
    assert np.isfinite(codec.decode(codec.encode(big, "fp16", 4), "fp16", 4)).all()


def test_error_feedback_keeps_the_sum():
    """What int8 drops in one step is carried to the next: the running sums stay close."""
    fb = codec.ErrorFeedback("int8", 64)
    total_in = np.zeros(4096, np.float64)
    total_out = np.zeros(4096, np.float64)
    for i in range(50):
        g = _vec(4096, seed=i)
        total_in += g
        total_out += codec.decode(fb.encode(g), "int8", 64)
    drift = np.abs(total_in - total_out).max()
    one_step = np.abs(_vec(4096) - codec.decode(codec.encode(_vec(4096), "int8", 64), "int8", 64)).max()
    assert drift <= 1.01 * np.abs(fb.residual).max() + 1e-7
    assert drift < 3 * one_step  # bounded, not growing with the number of steps


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4", "sparse"])
def test_chunked_storage_reads_any_range(bucket, name):
    fmt = VectorFormat(name, 10_000, 2048, 512)
    x = _vec(10_000)
    arrays = codec.encode(x, name, 512)
    sums = vector.write_vector(bucket, "v", fmt, arrays)
    assert all(len(s) == fmt.n_chunks == 5 for s in sums.values())
    whole = vector.read_vector(bucket, "v", fmt, checksums=sums)
    assert np.array_equal(whole, codec.decode(arrays, name, 512, 10_000))
    part = vector.read_vector(bucket, "v", fmt, range(2, 5), checksums=sums)
    assert np.array_equal(part, whole[4096:])


def test_a_fresh_process_reads_with_the_metadata_it_implies(bucket):
    """The implied metadata is made before zarr's event loop runs the reads (it cannot be made
    inside it): a process whose first request is a read, as a volunteer's is."""
    fmt = VectorFormat("int8", 5000, 1024, 256, whole=True)
    arrays = codec.encode(_vec(5000), "int8", 256)
    sums = vector.write_vector(bucket, "s", fmt, arrays)
    vector._metadata.cache_clear()
    got = vector.read_vector(bucket, "s", fmt, checksums=sums, raw=True)
    assert all(np.array_equal(got[k], arrays[k]) for k in arrays)


def test_partial_writes_fill_one_array(bucket):
    """Aggregators write disjoint chunk ranges of one array, each its chunks alone: no metadata is
    stored, and a chunk of zeros is no object at all."""
    fmt = VectorFormat("none", 5000, 1024, 256)
    x = _vec(5000)
    x[1024:2048] = 0
    vector.write_vector(bucket, "p", fmt, {"values": x[3072:]}, range(3, 5))
    vector.write_vector(bucket, "p", fmt, {"values": x[:3072]}, range(0, 3))
    assert sorted(bucket.sizes("p")) == ["p/values/c/0", "p/values/c/2", "p/values/c/3", "p/values/c/4"]
    assert np.array_equal(vector.read_vector(bucket, "p", fmt), x)


def test_corrupted_chunk_is_caught(bucket):
    fmt = VectorFormat("int8", 4096, 1024, 256)
    sums = vector.write_vector(bucket, "s", fmt, codec.encode(_vec(4096), "int8", 256))
    path = bucket.path("s/codes/c/2")
    other = codec.encode(_vec(4096, seed=9), "int8", 256)
    vector.write_vector(bucket, "t", fmt, other)
    with open(bucket.path("t/codes/c/2"), "rb") as f, open(path, "wb") as g:
        g.write(f.read())  # valid zarr bytes, wrong content
    vector.read_vector(bucket, "s", fmt, range(0, 2), checksums=sums)  # other chunks still fine
    with pytest.raises(CorruptShard, match="checksum"):
        vector.read_vector(bucket, "s", fmt, checksums=sums)
    # nothing stored reads as zeros: only its checksums tell a vector never written from one of zeros
    assert not vector.read_vector(bucket, "nothing", fmt).any()
    with pytest.raises(CorruptShard, match="checksum"):
        vector.read_vector(bucket, "nothing", fmt, checksums=sums)


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "sparse"])
def test_parameter_delta_rebuilds_the_commit_bit_for_bit(bucket, name):
    """A peer holding state r and the stored delta gets exactly the committed state r+1."""
    fmt = VectorFormat(name, 9000, 2048, 512)
    p_old = _vec(9000, seed=1, scale=0.05)
    residual = None
    for step in range(3):
        p_new = p_old - 1e-3 * np.sign(_vec(9000, seed=10 + step))
        before = 0 if residual is None else residual
        arrays, committed, residual = codec.delta_encode(p_old, p_new, name, 512, residual)
        sums = vector.write_vector(bucket, f"d{step}", fmt, arrays)
        stored = vector.read_vector(bucket, f"d{step}", fmt, checksums=sums, raw=True)
        rebuilt = codec.delta_apply(p_old, stored, name, 512)
        assert rebuilt.tobytes() == committed.tobytes()
        if name == "none":
            assert committed.tobytes() == p_new.tobytes()
        elif name == "sparse":  # what it dropped waits in the residual, exactly
            assert np.allclose(committed + residual, p_new + before, atol=1e-7)
        else:
            assert np.abs(committed - p_new).max() <= 2e-3 / 127 * (1.01 if name == "int8" else 1) + 1e-6
        p_old = committed


def test_a_vector_written_whole_reads_any_chunk_range_the_same_on_s3(s3_bucket, tmp_path):
    """A shard is one object (zarr's sharding codec; each chunk its codes then its scales), its
    metadata implied: read whole, or a range of its chunks as a partitioned aggregator does (the
    shard's index, then the chunks; the last one short), on S3 and on a local folder alike, and
    checked against the chunk hashes of the codec's arrays."""
    fmt = vector.VectorFormat("int8", 3000, 1024, 256, whole=True)
    arrays = codec.encode(np.random.default_rng(0).standard_normal(3000).astype(np.float32), "int8", 256)
    local = Bucket(str(tmp_path / "local"))
    sums = [vector.write_vector(b, "s", fmt, arrays) for b in (local, s3_bucket)]
    assert sums[0] == sums[1] and sorted(local.find("s")) == ["s/shard/c/0"]
    for chunks in (range(0, 3), range(0, 1), range(1, 2), range(2, 3), range(1, 3)):
        here, there = (vector.read_vector(b, "s", fmt, chunks, checksums=sums[0], raw=True) for b in (local, s3_bucket))
        lo, hi = fmt.bounds("codes", chunks)
        assert np.array_equal(here["codes"], arrays["codes"][lo:hi]) and np.array_equal(there["codes"], here["codes"])
        assert np.array_equal(there["scales"], here["scales"])
    with pytest.raises(ValueError, match="at once"):
        vector.write_vector(local, "t", fmt, {k: v[:1024] for k, v in arrays.items()}, range(0, 1))


def test_sparse_keeps_the_largest_sixty_fourth_of_each_block_in_two_bits(bucket):
    block, n = 4096, 4096 * 256 + 100  # a short last block too; large enough that metadata is a rounding error
    x = (np.random.default_rng(5).standard_t(3, n) * 1e-3).astype(np.float32)
    arrays = codec.encode(x, "sparse", block)
    y = codec.decode(arrays, "sparse", block, n)
    k = block // codec.SPARSE_KEEP
    for b in range(0, n, block):
        xb, yb = x[b:b + block], y[b:b + block]
        kept = np.flatnonzero(yb)
        assert len(kept) == min(k, len(xb))
        assert set(kept) == set(np.argsort(-np.abs(xb), kind="stable")[:len(kept)])  # the largest
        assert np.all(np.sign(yb[kept]) == np.sign(xb[kept]))
        assert len(np.unique(np.abs(yb[kept]))) <= 2  # one of the block's two magnitudes
    total = np.ones(n)  # an aggregator adds the kept positions alone
    codec.accumulate(total, arrays, "sparse", block, 0.5)
    assert np.array_equal(total, 1 + 0.5 * y.astype(np.float64))
    # the error feedback carries the rest: over many steps of one vector the sum catches up
    fb = codec.ErrorFeedback("sparse", block)
    total = sum(codec.decode(fb.encode(x), "sparse", block, n).astype(np.float64) for _ in range(128))
    assert np.linalg.norm(total / 128 - x) < 0.25 * np.linalg.norm(x)
    # bytes as written to the bucket, per element (SparseLoCo's budget: a few hundredths)
    fmt = VectorFormat("sparse", n, 1 << 16, block, whole=True)
    before = bucket.stats.bytes_written
    sums = vector.write_vector(bucket, "sp", fmt, arrays)
    assert (bucket.stats.bytes_written - before) / n < 0.05
    assert np.array_equal(vector.read_vector(bucket, "sp", fmt, checksums=sums), y)


def test_a_sparse_position_outside_its_block_is_refused():
    arrays = codec.encode(_vec(1024), "sparse", 256)
    arrays["indices"][3] = 300  # would land in the next block
    with pytest.raises(ValueError, match="outside its block"):
        codec.decode(arrays, "sparse", 256, 1024)
    with pytest.raises(ValueError, match="outside its block"):
        codec.squared_norm(arrays, "sparse", 256)
