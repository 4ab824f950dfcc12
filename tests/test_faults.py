"""The fault matrix (docs/faults.md): what is injected, and what must hold afterwards."""

from __future__ import annotations

import pytest

from dedloc_pipeline.run import init_run
from dedloc_pipeline.storage import Bucket, StorageError

from .conftest import small_config
from .faults import Faults, inject
from .protocol_driver import collaborate

PEERS = [("a", 4), ("b", 3), ("c", 5)]


# case 6: storage faults

@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_collaboration_through_a_failing_bucket_commits_the_same_states(backend, tmp_path, request):
    """10% of requests fail or time out (half of them after taking effect), in every process's
    filesystem calls and zarr chunk I/O: retries carry the run to the same states, bit for bit,
    as a run on a healthy bucket, with nothing rejected on the way."""
    cfg = small_config(codec="int8", delayed_updates=True)
    healthy = init_run(Bucket(str(tmp_path / "healthy")), cfg)
    collaborate(healthy, PEERS, rounds=3)

    url = str(tmp_path / "faulty") if backend == "file" else request.getfixturevalue("s3_bucket").url
    faults = Faults(0.10, seed=1)
    run = init_run(inject(Bucket(url), faults), cfg)
    collaborate(run, PEERS, rounds=3)

    assert faults.injected["before"] > 20 and faults.injected["after"] > 20, faults.injected
    for s in range(1, 4):
        assert run.commit_of(s)["checksums"] == healthy.commit_of(s)["checksums"]
        assert run.commit_of(s)["rejected"] == []


def test_a_bucket_that_stays_down_ends_in_a_clear_error_not_a_loop(tmp_path):
    """Chunk I/O gives up like the Bucket's own calls: a StorageError naming the bucket."""
    run = init_run(Bucket(str(tmp_path / "b")), small_config())
    inject(run.bucket, Faults(1.0))
    with pytest.raises(StorageError, match="unreachable"):
        run.load_params(0)
