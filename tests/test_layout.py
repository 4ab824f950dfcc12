"""The layout parses back every key it spells, and refuses what it did not spell."""

from __future__ import annotations

import pytest

from dedloc_pipeline.storage.layout import DataLayout, RunLayout


def test_every_parsed_key_round_trips():
    keys = RunLayout("demo")
    shard = keys.shard(12, "alice.gpu", "0001-ab")
    assert keys.shard_parts(shard) == (12, "alice.gpu", "0001-ab")
    assert keys.round_of(shard) == keys.round_of(keys.manifest(shard)) == keys.round_of(keys.progress(12, "x")) == 12
    assert keys.shard_of(keys.manifest(shard)) == shard
    assert keys.manifest(shard).startswith(keys.manifests_dir(12, "alice.gpu") + "/")
    assert keys.peer_of_progress(keys.progress(3, "bob")) == "bob"
    assert keys.state(7).startswith(keys.states + "/")
    assert keys.state_number(keys.state(7).rsplit("/", 1)[1]) == 7
    assert DataLayout("bn").root.startswith(DataLayout.ROOT + "/")


@pytest.mark.parametrize("bad", ["runs/demo/state/00000001/COMMIT.json", "runs/other/rounds/00000001/x",
                                 "runs/demo/rounds/abc/x"])
def test_a_key_of_no_round_is_refused(bad):
    with pytest.raises(ValueError, match="not a key of a round"):
        RunLayout("demo").round_of(bad)


def test_listing_debris_is_no_state():
    keys = RunLayout("demo")
    assert keys.state_number("LATEST.json") is None and keys.state_number("123") is None
    with pytest.raises(ValueError, match="not a shard key"):
        keys.shard_parts(keys.progress(1, "p"))


def test_everything_a_volunteer_writes_lies_below_its_own_prefix():
    keys = RunLayout("demo")
    shard = keys.shard(5, "alice", "0001-ab")
    own = keys.volunteer_dir("alice") + "/"
    for key in (keys.progress(5, "alice"), shard, keys.manifest(shard), f"{shard}/shard/c/0"):
        assert key.startswith(own) and keys.writer(key) == "alice"
    assert keys.written(f"{shard}/shard/c/0") == ("alice", 5, "object", "0001-ab", "shard/c/0")
    assert keys.shard_holding(f"{shard}/shard/c/0") == shard and keys.shard_holding(keys.manifest(shard)) is None
    listed = [keys.progress(5, "alice"), keys.progress(6, "alice"), keys.manifest(shard), f"{shard}/shard/c/0",
              keys.progress(5, "bob")]
    assert keys.of_round(listed, 5, "progress") == [keys.progress(5, "alice"), keys.progress(5, "bob")]
    assert keys.of_round(listed, 5, "manifest") == [keys.manifest(shard)]
    assert keys.frozen(shard) == f"{keys.round(5)}/frozen/alice/0001-ab"  # the organizer's copy, outside it
    aggregating = {keys.claim(5, "alice", 3): "claim", keys.result(5, "alice", 3): "result",
                   keys.sum_claim(5, "alice", 3): "sum_claim", keys.sums(5, "alice", 3): "sums"}
    for key, kind in aggregating.items():
        assert key.startswith(own) and keys.written(key) == ("alice", 5, kind, "00003", "")
        assert keys.of_round([*listed, *aggregating], 5, kind) == [key]


def _fill(bucket, keys, counts: dict[str, int]) -> None:
    objects = {keys.progress(i, peer): b"{}" for peer, n in counts.items() for i in range(n)}
    if bucket.local:
        for key, data in objects.items():
            bucket.write_bytes(key, data)
    else:  # one batch of PUTs, concurrent
        bucket.fs.pipe({bucket.path(k): v for k, v in objects.items()})


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_listing_takes_at_most_its_bound_of_each_folder_and_goes_on_after_a_full_one(where, bucket, request):
    """``per_folder``: each peer's folder gives at most that many keys and one more (which says
    it has more), and the listing goes on after it: a LIST page for each full folder, not one
    per 1000 of its keys (on S3, StartAfter); the control: without the bound, all of them."""
    if where == "s3":
        bucket = request.getfixturevalue("s3_bucket")
    keys = RunLayout("demo")
    _fill(bucket, keys, {"aa": 3, "alice": 1500, "alice.x": 2, "alicez": 2, "bob": 4})
    before = bucket.stats.requests.get("list", 0)
    listed = bucket.listing(keys.volunteers_dir, per_folder=5)
    counts = {p: sum(keys.writer(k) == p for k in listed) for p in ("aa", "alice", "alice.x", "alicez", "bob")}
    assert counts == {"aa": 3, "alice": 6, "alice.x": 2, "alicez": 2, "bob": 4}
    if where == "s3":
        assert bucket.stats.requests["list"] - before == 2  # a page up to alice's sixth key, then after alice/
    assert len(bucket.listing(keys.volunteers_dir)) == 1511
