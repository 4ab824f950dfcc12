"""The bucket: create-once markers, whole writes, bounded retries, on every backend."""

import json
import os
import threading
import time

import numpy as np
import pytest

from dedloc_pipeline.storage import vector
from dedloc_pipeline.storage.bucket import Bucket, StorageError
from dedloc_pipeline.storage.retry import RetryPolicy


@pytest.fixture(params=["file", "memory", "s3"])
def any_bucket(request, tmp_path):
    if request.param == "file":
        return Bucket(str(tmp_path / "b"))  # a plain path is a local bucket
    if request.param == "memory":
        return Bucket(f"memory://dedloc-{time.time_ns()}")
    return request.getfixturevalue("s3_bucket")


def test_read_write_list(any_bucket):
    b = any_bucket
    assert b.read_bytes("a/x.json") is None and b.read_json("a/x.json") is None
    b.write_json("a/x.json", {"v": 1})
    b.write_bytes("a/y/z.bin", b"zz")
    assert b.read_json("a/x.json") == {"v": 1}
    assert b.list("a") == ["x.json", "y"]
    assert b.find("a") == ["a/x.json", "a/y/z.bin"]
    assert b.read_many(["a/x.json", "a/missing"]) == {"a/x.json": b'{\n "v": 1\n}', "a/missing": None}
    b.delete("a/y")
    assert b.find("a") == ["a/x.json"]


def test_a_bounded_read_takes_at_most_its_limit_even_of_an_empty_object(any_bucket):
    """``read_if_changed(limit=)`` is how a reader bounds what a volunteer wrote: a ranged GET on
    S3, which answers an empty object with 416 (not satisfiable), read here as its no bytes
    rather than retried into an unreachable bucket."""
    b = any_bucket
    b.write_bytes("r/empty", b"")
    b.write_bytes("r/big", b"x" * 100)
    assert b.read_if_changed("r/empty", None, limit=10).data == b""
    assert b.read_if_changed("r/big", None, limit=10).data == b"x" * 10
    assert b.read_if_changed("r/big", None).data == b"x" * 100
    assert b.read_if_changed("r/missing", None, limit=10).data is None


def test_delete_keeps_what_it_is_told_and_leaves_no_empty_folders(any_bucket):
    """Pruning a state keeps its COMMIT (and a checkpoint's parameters): one listing of the
    state, and afterwards its deleted folders list as absent, on a local folder as on S3."""
    b = any_bucket
    for key in ("s/COMMIT.json", "s/params/c/0", "s/params/c/1", "s/delta/c/0", "s/optim/m/c/0"):
        b.write_bytes(key, b"x")
    b.delete("s", keep=("s/COMMIT.json", "s/params"))
    assert b.find("s") == ["s/COMMIT.json", "s/params/c/0", "s/params/c/1"]
    assert b.list("s") == ["COMMIT.json", "params"] and b.list("s/delta") == [] and b.list("s/optim") == []
    b.delete("s", keep=("s/COMMIT.json",))
    assert b.find("s") == ["s/COMMIT.json"] and b.list("s/params") == []


def test_create_happens_once(any_bucket):
    b = any_bucket
    assert b.create_json("m/COMMIT.json", {"who": 1})
    assert not b.create_json("m/COMMIT.json", {"who": 2})
    assert b.read_json("m/COMMIT.json") == {"who": 1}


def test_concurrent_creates_have_one_winner(tmp_path):
    b = Bucket(f"file://{tmp_path}/b")
    wins = []
    barrier = threading.Barrier(8)

    def race(i):
        barrier.wait()
        if b.create_json("CLOSE.json", {"i": i}):
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(wins) == 1 and b.read_json("CLOSE.json") == {"i": wins[0]}


def test_local_writes_land_whole(tmp_path):
    """Readers never see half a file: writes go to a temporary name, then are renamed."""
    b = Bucket(str(tmp_path / "b"))
    b.write_bytes("k", b"1" * 1000)
    b.write_bytes("k", b"2" * 1000)
    assert b.read_bytes("k") == b"2" * 1000
    assert [f for f in os.listdir(tmp_path / "b") if f.startswith(".")] == []


@pytest.mark.parametrize("when", ["before its bytes", "before its rename", "control: no prune"])
@pytest.mark.parametrize("call", ["write_bytes", "create"])
def test_a_write_into_a_folder_a_prune_removes_meanwhile_lands(tmp_path, monkeypatch, when, call):
    """On a local folder a write makes its folder, writes its bytes beside the key, then renames
    (or links) them into place; a prune of the same prefix (the scheduler's of a volunteer's old
    round, as the volunteer heartbeats into it) may remove the folder between those steps. The
    write lands anyway, as on S3, where no folder is in the way: the folder is made again (a
    worker died of this, [Errno 2], on the embedded default bucket)."""
    b = Bucket(str(tmp_path / "b"))
    b.write_bytes("r/00000025/old.json", b"x")
    step = {"before its bytes": "pipe_file", "before its rename": "mv" if call == "write_bytes" else "link"}.get(when)
    pruned = []
    if step is not None:
        original = getattr(type(b.fs), step)

        def interleaved(fs, *args, **kwargs):
            if not pruned:  # the prune runs just before this step, once
                pruned.append(True)
                b.delete("r/00000025")
            return original(fs, *args, **kwargs)
        monkeypatch.setattr(type(b.fs), step, interleaved)
    getattr(b, call)("r/00000025/progress.json", b"beat")
    assert b.read_bytes("r/00000025/progress.json") == b"beat" and bool(pruned) == (step is not None)
    assert [f for f in os.listdir(tmp_path / "b" / "r" / "00000025") if f.startswith(".")] == []


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    b = Bucket(str(tmp_path / "b"))
    b.write_json("k", {"ok": True})
    real, calls = b.fs.cat_file, []

    def flaky(path, *a, **kw):
        calls.append(path)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return real(path, *a, **kw)

    monkeypatch.setattr(b.fs, "cat_file", flaky)
    assert b.read_json("k") == {"ok": True} and len(calls) == 3


def test_permanent_errors_are_not_retried(tmp_path, monkeypatch):
    b = Bucket(str(tmp_path / "b"))
    calls = []

    def denied(path, *a, **kw):
        calls.append(path)
        raise PermissionError("access denied")

    monkeypatch.setattr(b.fs, "cat_file", denied)
    with pytest.raises(PermissionError):
        b.read_bytes("k")
    assert len(calls) == 1


def test_unreachable_bucket_gives_up_with_a_clear_error(tmp_path, monkeypatch):
    """A request that times out is tried the policy's attempts, then fails in one line (the
    backoff between the tries, up to 6 s by default, made instant here: no test sleeps)."""
    b = Bucket(str(tmp_path / "b"), retry=RetryPolicy(wait_s=0.0))
    tries = []
    monkeypatch.setattr(b.fs, "cat_file", lambda *a, **k: tries.append(1) or (_ for _ in ()).throw(
        TimeoutError("timed out")))
    with pytest.raises(StorageError, match="unreachable"):
        b.read_bytes("k")
    assert len(tries) == RetryPolicy().attempts


def test_s3_markers_use_conditional_writes(s3_bucket):
    """On S3 the create-once rule is the server's If-None-Match, not a check-then-write."""
    assert s3_bucket.create("x/M.json", b"1")
    with pytest.raises(FileExistsError):
        s3_bucket.fs.pipe_file(s3_bucket.path("x/M.json"), b"2", mode="create")
    assert json.loads(s3_bucket.read_bytes("x/M.json")) == 1


def test_io_stats_count_every_request_and_byte(any_bucket):
    """What benchmarks and heartbeats report as traffic: the Bucket's calls and its zarr stores'."""
    import numpy as np

    from dedloc_pipeline.storage import vector

    b = any_bucket
    b.write_bytes("t/a.bin", b"x" * 1000)
    assert b.read_bytes("t/a.bin") == b"x" * 1000 and b.read_bytes("t/none") is None
    b.read_many(["t/a.bin", "t/none"])
    b.exists("t/a.bin")
    b.find("t")
    got = b.stats.snapshot()
    assert got["requests"] == {"put": 1, "get": 4, "head": 1, "list": 1}
    assert got["bytes_written"] == 1000 and got["bytes_read"] == 2000
    fmt = vector.VectorFormat("none", 1000, 500, 100)
    vector.write_vector(b, "t/v", fmt, {"values": np.arange(1000, dtype=np.float32)})
    wrote = b.stats.snapshot()["bytes_written"] - 1000
    assert 1000 < wrote < 4000 + 2 * 64  # two chunks in Blosc frames, no metadata (it is the run's)
    before = b.stats.snapshot()
    vector.read_vector(b, "t/v", fmt, range(1, 2))
    after = b.stats.snapshot()
    assert after["requests"]["get"] - before["requests"]["get"] == 1  # one chunk: no metadata read
    assert 0 < after["bytes_read"] - before["bytes_read"] < wrote


def test_kept_vectors_are_taken_once_against_their_record_and_bounded():
    """What the organizer keeps of what it wrote (``vector.Kept``): handed back once, only for
    the checksums its record names, and the oldest dropped past the limit."""
    v = lambda x: {"values": np.full(256, x, np.float32)}  # noqa: E731 (1 KiB)
    kept = vector.Kept(limit_bytes=2048)
    kept.put("s/1", 0, {"params": v(1)}, {"params": ["a"]})
    assert kept.take("s/1", 0, lambda: {"params": ["b"]}) is None  # rewritten since: read it
    assert kept.take("s/1", 0, lambda: {"params": ["a"]}) is None  # and not held any more
    kept.put("s/1", 0, {"params": v(1)}, {"params": ["a"]})
    assert kept.take("s/1", 0, lambda: None) is None  # no record
    asked = []
    assert kept.take("s/1", 0, lambda: asked.append(1)) is None and not asked  # nothing held: no record read
    for part in range(3):
        kept.put("s/2", part, {"params": v(part)}, {"params": [str(part)]})
    assert kept.take("s/2", 0, lambda: {"params": ["0"]}) is None  # the oldest, dropped past 2 KiB
    assert kept.take("s/2", 2, lambda: {"params": ["2"]})["params"]["values"][0] == 2
