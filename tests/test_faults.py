"""The fault matrix (docs/faults.md): what is injected, and what must hold afterwards."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dedloc_pipeline import codec, identity, shard
from dedloc_pipeline.run import init_run
from dedloc_pipeline.scheduler import Scheduler
from dedloc_pipeline.storage import Bucket, StorageError
from dedloc_pipeline.worker import Worker

from .conftest import small_config
from .faults import Faults, inject
from .protocol_driver import collaborate

PEERS = [("a", 4), ("b", 3), ("c", 5)]


def finish(run, r):
    with ThreadPoolExecutor(2) as pool:
        return Scheduler(run, 2, 0).finish(r, pool)


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


# cases 7 and 10: signed manifests, enrolled volunteers, replays

def _upload(run, r, peer, signer=None, part="0001", samples=24, scale=1e-4):
    grad = np.full(run.flat.n, scale, np.float32)
    arrays = codec.encode(grad, run.config.codec, run.config.block_size)
    return shard.upload(run, r, peer, part, arrays, samples, 5.0,
                        shard.DataRef(stream=peer, ranges=[(0, samples)]), signer=signer)


@pytest.fixture
def signed(tmp_path, bucket):
    """A run that admits only signed shards; alice and bob enrolled, mallory not."""
    org = identity.generate(tmp_path / "keys/org.pem")
    run = init_run(bucket, small_config(organizer_key=identity.public(org)))
    keys = {n: identity.generate(tmp_path / f"keys/{n}.pem") for n in ("alice", "bob", "mallory")}
    identity.update_roster(bucket, run.name, org, enroll={n: identity.public(keys[n]) for n in ("alice", "bob")})
    return run, org, keys


def _copy_shard(run, src, dst, edit=None):
    """Copy a shard's chunks and manifest to another key (what a replaying attacker does)."""
    b = run.bucket
    for k in b.find(src):
        b.write_bytes(dst + k[len(src):], b.read_bytes(k))
    m = b.read_json(run.keys.manifest(src))
    m.update(edit or {})
    b.write_json(run.keys.manifest(dst), m)


@pytest.mark.parametrize("attack,reason", [
    ("unsigned", "unsigned shard"),
    ("unknown_key", "not enrolled"),
    ("impersonation", "signature does not match"),
    ("revoked", "revoked"),
    ("replayed_into_next_round", "round=0, expected 1"),
    ("replayed_edited", "signature does not match"),
    ("duplicated_part", "part="),
    ("forged_roster", "not enrolled"),
    ("replayed_roster", "revoked"),
])
def test_only_enrolled_volunteers_shards_count(signed, caplog, attack, reason):
    run, org, keys = signed
    b, k = run.bucket, run.keys
    sched = Scheduler(run, 1, 0)
    if attack.startswith("replayed_into") or attack.startswith("replayed_edited"):
        old = _upload(run, 0, "alice", keys["alice"])
        assert sched.try_close(0) and finish(run, 0)["contributors"] == ["alice"]
        r = 1
    else:
        r = 0
    _upload(run, r, "alice", keys["alice"], part="good")
    bad = k.shard(r, {"unknown_key": "mallory", "unsigned": "bob"}.get(attack, "bob"), "0002")
    peer = bad.rsplit("/", 2)[1]
    if attack == "unsigned":
        _upload(run, r, peer, None, part="0002")
    elif attack == "unknown_key":
        _upload(run, r, peer, keys["mallory"], part="0002")
    elif attack == "impersonation":
        _upload(run, r, peer, keys["mallory"], part="0002")
    elif attack == "revoked":
        identity.update_roster(b, run.name, org, revoke=["bob"])
        _upload(run, r, peer, keys["bob"], part="0002")
    elif attack == "replayed_into_next_round":
        bad = k.shard(r, "alice", "0002")
        _copy_shard(run, old, bad)
    elif attack == "replayed_edited":
        bad = k.shard(r, "alice", "0002")
        _copy_shard(run, old, bad, edit={"round": 1, "part": "0002"})
    elif attack == "duplicated_part":
        bad = k.shard(r, "alice", "0002")
        _copy_shard(run, k.shard(r, "alice", "good"), bad)
    elif attack == "forged_roster":  # mallory overwrites the roster, signed with her own key
        sched.roster()
        forged = identity.Roster(run=run.name, version=99, volunteers={"mallory": identity.public(keys["mallory"])})
        forged.signature = identity.sign(keys["mallory"], forged.payload())
        b.write_bytes(k.roster, forged.model_dump_json().encode())
        bad = _upload(run, r, "mallory", keys["mallory"], part="0002")
    elif attack == "replayed_roster":  # the roster from before bob's revocation, written back
        before = b.read_bytes(k.roster)
        identity.update_roster(b, run.name, org, revoke=["bob"])
        sched.roster()
        b.write_bytes(k.roster, before)
        _upload(run, r, "bob", keys["bob"], part="0002")
    with caplog.at_level(logging.WARNING, logger="dedloc_pipeline.scheduler"):
        close = sched.try_close(r)
    assert [s["key"] for s in close["accepted"]] == [k.shard(r, "alice", "good")]
    assert len(close["rejected"]) == 1 and close["rejected"][0]["key"] == bad
    assert reason in close["rejected"][0]["reason"], close["rejected"][0]["reason"]
    assert any("rejected shard" in rec.message for rec in caplog.records)
    if attack.endswith("roster"):
        assert any("roster" in rec.message and rec.levelname == "ERROR" for rec in caplog.records)


def test_a_worker_without_an_enrolled_key_is_told_at_start(signed, tmp_path):
    run, _, keys = signed
    with pytest.raises(identity.IdentityError, match="pass --key"):
        Worker(run, "alice")
    with pytest.raises(identity.IdentityError, match="not enrolled.*public key"):
        Worker(run, "mallory", signer=keys["mallory"])
    with pytest.raises(identity.IdentityError, match="another key"):
        Worker(run, "alice.laptop", signer=keys["bob"])


def test_signed_volunteers_train_a_run(signed):
    run, _, keys = signed
    collaborate(run, [("alice", 4), ("bob.gpu2", 4)], rounds=2,
                signers={"alice": keys["alice"], "bob.gpu2": keys["bob"]})
    for r in range(2):
        close = run.bucket.read_json(run.keys.close(r))
        assert close["rejected"] == [] and close["roster"] == 1 and close["samples"] >= 24
