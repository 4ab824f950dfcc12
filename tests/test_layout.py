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
