"""The fault matrix (docs/faults.md): what is injected, and what must hold afterwards."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dedloc_pipeline.faults import Faults, FaultyStore, inject
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import shard
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage import codec, vector
from dedloc_pipeline.storage.bucket import Bucket, StorageError
from dedloc_pipeline.storage.retry import RetryPolicy
from dedloc_pipeline.testing import FakeClock, collaborate, on_clock, stream_next, written
from dedloc_pipeline.trust import identity
from dedloc_pipeline.volunteer.worker import Worker

from .conftest import small_config

PEERS = [("a", 4), ("b", 3), ("c", 5)]


def finish(run, r):
    with ThreadPoolExecutor(2) as pool:
        return Scheduler(run, 2, 0).finish(r, pool)


# case 6: storage faults

@pytest.mark.parametrize("backend", ["file", "s3"])
@pytest.mark.slow
def test_a_collaboration_through_a_failing_bucket_commits_the_same_states(backend, tmp_path, request):
    """10% of requests fail or time out (half of them after taking effect), in every peer's and
    the scheduler's filesystem calls and zarr chunk I/O: retries carry the run to the same
    states, bit for bit, as a run on a healthy bucket, with nothing rejected on the way."""
    cfg = small_config(codec="int8", delayed_updates=True)
    healthy = init_run(Bucket(str(tmp_path / "healthy")), cfg)
    rounds = 2  # every kind of request (init, shards, closes, reduces, commits, deltas) meets faults
    collaborate(healthy, PEERS, rounds=rounds)

    url = str(tmp_path / "faulty") if backend == "file" else request.getfixturevalue("s3_bucket").url
    faults = Faults(0.10, seed=1)
    run = init_run(inject(Bucket(url), faults), cfg)
    collaborate(run, PEERS, rounds=rounds)

    # about 300 requests at 10%, half failing before taking effect and half after: some of each
    # (the draws follow the bucket's name, random on S3: 13 to 45 of each measured)
    assert faults.injected["before"] > 5 and faults.injected["after"] > 5, faults.injected
    for s in range(1, rounds + 1):
        assert run.commit_of(s)["checksums"] == healthy.commit_of(s)["checksums"]
        assert run.commit_of(s)["rejected"] == []


def test_a_bucket_down_while_a_shard_is_judged_fails_the_poll_not_the_shard(make_run):
    """Chunk reads failing past their retries are the bucket's fault: the poll raises StorageError
    and the honest shard is judged again at the next one. (The soak with faults found them read
    as undecodable chunks: the shard rejected, its samples spent, a flaky read in `dedloc repair`
    taken for a damaged state.)"""
    run = make_run(codec="int8")
    key = _upload(run, 0, "a")  # the round's 24 samples
    faults, store = Faults(1.0), run.bucket._store
    run.bucket._store = lambda k: FaultyStore(store(k), faults)  # chunk I/O only: listings answer
    run.bucket.retry = RetryPolicy(attempts=2, wait_s=0, max_wait_s=0)
    sched = Scheduler(run, 1, 0)
    with pytest.raises(StorageError, match="unreachable"):
        sched.try_close(0)
    faults.rate = 0.0
    close = sched.try_close(0)
    assert close is not None and [s.key for s in close.accepted] == [key] and close.rejected == []


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
                        shard.DataRef(stream=peer, ranges=[(stream_next(run, r, peer), samples)]), signer=signer)


@pytest.fixture
def signed(tmp_path, bucket):
    """A run that admits only signed shards; alice and bob enrolled, mallory not."""
    org = identity.generate(tmp_path / "keys/org.pem")
    run = init_run(bucket, small_config(organizer_key=identity.public(org)), organizer=org)
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
    peer = k.shard_parts(bad)[1]
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
        sched.judge.roster()
        forged = identity.Roster(run=run.name, version=99, volunteers={"mallory": identity.public(keys["mallory"])})
        forged.signature = identity.sign(keys["mallory"], forged.payload())
        b.write_bytes(k.roster, forged.model_dump_json().encode())
        bad = _upload(run, r, "mallory", keys["mallory"], part="0002")
    elif attack == "replayed_roster":  # the roster from before bob's revocation, written back
        before = b.read_bytes(k.roster)
        identity.update_roster(b, run.name, org, revoke=["bob"])
        sched.judge.roster()
        b.write_bytes(k.roster, before)
        _upload(run, r, "bob", keys["bob"], part="0002")
    with caplog.at_level(logging.WARNING, logger="dedloc_pipeline.organizer.scheduler"):
        close = sched.try_close(r)
    assert [s.key for s in close.accepted] == [k.shard(r, "alice", "good")]
    assert len(close.rejected) == 1 and close.rejected[0].key == bad
    assert reason in close.rejected[0].reason, close.rejected[0].reason
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


# case 9: oversized and outsized shards

def _noise(run, seed, scale=1e-3):
    return np.random.default_rng(seed).standard_normal(run.flat.n).astype(np.float32) * scale


@pytest.mark.parametrize("fault,reason", [
    ("padded_manifest", "manifest of"),
    ("stuffed_shard", "more than its format takes"),
    ("scaled_x1000", "median"),
])
def test_oversized_and_outsized_shards_are_rejected_before_they_count(make_run, caplog, fault, reason):
    """Bounds that hold at any stage of training: bytes an honest shard cannot take (checked
    before anything is read), and a norm far above the round's median (default 10x)."""
    run = make_run(codec="int8")
    b, k = run.bucket, run.keys
    honest = [shard.upload(run, 0, p, "0001", codec.encode(_noise(run, i), "int8", 4096), 8, 5.0,
                           shard.DataRef(stream=p, ranges=[(0, 8)])) for i, p in enumerate("abc")]
    grad = _noise(run, 9) * (1000 if fault == "scaled_x1000" else 1)
    bad = shard.upload(run, 0, "mallory", "0001", codec.encode(grad, "int8", 4096), 8, 5.0,
                       shard.DataRef(stream="mallory", ranges=[(0, 8)]))
    if fault == "padded_manifest":  # valid JSON, a megabyte of it
        b.write_bytes(k.manifest(bad), b.read_bytes(k.manifest(bad)) + b" " * (1 << 20))
    if fault == "stuffed_shard":
        b.write_bytes(f"{bad}/codes/c/junk", np.random.default_rng(0).bytes(4 * run.flat.n))
    with caplog.at_level(logging.WARNING, logger="dedloc_pipeline.organizer.scheduler"):
        close = Scheduler(run, 1, 0).try_close(0)
    assert sorted(s.key for s in close.accepted) == honest
    assert [s.key for s in close.rejected] == [bad] and reason in close.rejected[0].reason
    assert any(bad in rec.message for rec in caplog.records)


# case 11: byzantine peers

def _heldout_loss(run, state):
    from dedloc_pipeline.model.albert import pretraining_loss_sum
    from dedloc_pipeline.model.data import make_source
    from dedloc_pipeline.model.flat import FlatLayout
    model = run.build_model()
    FlatLayout(model).set(run.load_params(state))
    batch = make_source(run).batch("heldout", 0, 32)
    with torch.no_grad():
        return float(pretraining_loss_sum(model, batch)) / 32


@pytest.mark.parametrize("aggregation,attack,falls", [
    ("mean", "flipped_x1000", False),  # the attack works on an unprotected mean ...
    ("trimmed_mean", "flipped_x1000", True),  # ... and not through a robust estimate
    ("centered_clip", "flipped_x1000", True),
    ("centered_clip", "flipped", True),
])
@pytest.mark.slow
def test_byzantine_peers_cannot_stop_training(make_run, aggregation, attack, falls):
    """One peer in five (20%) sends its gradient sign-flipped, or scaled x(-1000), every round.
    The norm screen is off here, so only the aggregation stands in the way (a gradient scaled
    x1000 alone is the norm screen's case, above)."""
    factor = {"flipped_x1000": -1000.0, "flipped": -1.0}[attack]
    run = make_run(aggregation=aggregation, norm_screen=None, max_grad_norm=1e12, seq_len=32)
    peers = [(p, 4) for p in ("a", "b", "c", "d", "mallory")]
    collaborate(run, peers, rounds=3, tamper={"mallory": lambda g: factor * g})
    assert all("mallory" in run.commit_of(s)["contributors"] for s in range(1, 4))
    before, after = _heldout_loss(run, 0), _heldout_loss(run, 3)
    assert (after < before - 0.05) is falls, (before, after)


# case 1: a worker killed mid-upload

KILLED_AT_THE_MANIFEST = """
import os, signal, sys
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.volunteer.worker import Worker
from dedloc_pipeline.storage.bucket import Bucket
run = Run(Bucket(sys.argv[1]), sys.argv[2])
write_json = run.bucket.write_json
def dies_before_manifests(key, obj):
    if "/manifests/" in key:  # every chunk is written; the marker is next
        os.kill(os.getpid(), signal.SIGKILL)
    write_json(key, obj)
run.bucket.write_json = dies_before_manifests
Worker(run, "a", micro_batch=4, threads=1, poll_s=0).serve()
"""


@pytest.mark.slow  # a worker process, killed
def test_a_worker_killed_between_its_chunks_and_its_manifest(make_run):
    """SIGKILL after the chunks, before the manifest: the torn shard is never read, the peer
    restarted computes those samples again (they were never counted), and pruning removes the debris."""
    import subprocess
    import sys
    run = make_run(keep_states=2)
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_THE_MANIFEST, run.bucket.url, run.name], timeout=120)
    assert proc.returncode == -9
    b, k = run.bucket, run.keys
    torn = {k.shard_holding(key) for key in written(run, 0, "object")}
    assert len(torn) == 1 and written(run, 0) == [] and b.find(next(iter(torn)))
    # restarted once its heartbeat is peer_timeout_s old (sooner, its id counts as live elsewhere)
    later = FakeClock(epoch=time.time() + run.config.peer_timeout_s)
    collaborate(on_clock(run, later), [("a", 4), ("b", 4)], rounds=4)
    close = b.read_json(k.close(0))
    listed = [s["key"] for s in close["accepted"] + close["rejected"]]
    assert torn.isdisjoint(listed) and close["rejected"] == [] and close["samples"] >= 24
    first = min(start for s in close["accepted"] if s["peer"] == "a" for start, _ in s["data"]["ranges"])
    assert first == 0  # the killed upload's samples come again, counted once
    assert written(run, 0, "object") == []  # pruned with its round


def test_the_norm_screen_spares_honest_small_shards(make_run):
    """A mean over 1 sample is ~sqrt(256) = 16 times noisier than one over 256: not an outlier."""
    run = make_run(codec="int8", target_batch_size=64)  # a shard may claim up to 4 target batches
    rng = np.random.default_rng(0)
    keys = []
    for i, n in enumerate([256, 256, 256, 1]):
        g = rng.standard_normal(run.flat.n).astype(np.float32) * 1e-3 / np.sqrt(n)
        keys.append(shard.upload(run, 0, f"p{i}", "0001", codec.encode(g, "int8", 4096), n, 5.0,
                                 shard.DataRef(stream=f"p{i}", ranges=[(0, n)])))
    close = Scheduler(run, 1, 0).try_close(0)
    assert close.rejected == [] and sorted(s.key for s in close.accepted) == keys


# case 13: one volunteer, many parts (influence is bounded per volunteer, not per shard)

def _part(run, peer, part, grad, samples, start=0):
    return shard.upload(run, 0, peer, part, codec.encode(grad, run.config.codec, run.config.block_size),
                        samples, 5.0, shard.DataRef(stream=peer, ranges=[(start, samples)]))


def test_many_tiny_parts_from_one_volunteer_do_not_move_the_norm_screen(make_run):
    """Four tiny-norm parts from mallory beside three honest volunteers: the screen's medians are
    over volunteers, so the honest shards stay in. Control: over shards, the median would be
    mallory's and every honest shard would be above 10x it."""
    run = make_run(codec="int8", target_batch_size=8)
    honest = [_part(run, p, "0001", _noise(run, i), 8) for i, p in enumerate("abc")]
    tiny = [_part(run, "mallory", f"000{j}", _noise(run, 10 + j, 1e-7), 8, 8 * j) for j in range(1, 5)]
    close = Scheduler(run, 1, 0).try_close(0)
    assert close.rejected == [] and sorted(s.key for s in close.accepted) == sorted(honest + tiny)
    norms = {s.key: s.norm for s in close.accepted}
    per_shard_bound = run.config.norm_screen * float(np.median(list(norms.values())))
    assert all(norms[k] > per_shard_bound for k in honest)  # what the old screen did to them


def test_a_volunteers_parts_beyond_max_parts_are_rejected(make_run):
    run = make_run(close={"max_parts": 2})
    first = [_part(run, "mallory", f"000{j}", _noise(run, j), 4, 4 * j) for j in range(1, 4)]
    honest = _part(run, "a", "0001", _noise(run, 9), 16)  # 4 + 4 + 16: the target
    close = Scheduler(run, 1, 0).try_close(0)
    assert sorted(s.key for s in close.accepted) == sorted(first[:2] + [honest])
    assert [s.key for s in close.rejected] == [first[2]]
    assert "above close.max_parts=2" in close.rejected[0].reason


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "centered_clip"])
def test_claimed_samples_in_many_parts_buy_no_robust_weight(make_run, aggregation):
    """Mallory sends the honest direction reversed in 4 parts, each claiming 50 samples (more
    would start past its stream's window). Robust weights are capped at the median volunteer's
    samples and a volunteer's parts are one row, so the reduced gradient still points the honest
    way. Control: with a row per shard, and the cap at the median shard (mallory's), it points
    mallory's way."""
    run = make_run(aggregation=aggregation, norm_screen=None, max_grad_norm=1e12, target_batch_size=24)
    base = _noise(run, 0)
    honest = [base + _noise(run, 1 + i, 2e-4) for i in range(3)]
    for p, g in zip("abc", honest):
        _part(run, p, "0001", g, 8)
    for j in range(1, 5):
        _part(run, "mallory", f"000{j}", -base, 50, 50 * (j - 1))
    with ThreadPoolExecutor(2) as pool:
        sched = Scheduler(run, 2, 0)
        close = sched.try_close(0)
        assert len(close.accepted) == 7
        sched.finish(0, pool)
    reduced = vector.read_vector(run.bucket, run.keys.reduced(0), run.dense_format)

    def cos(x):
        return float(x @ base / np.linalg.norm(x) / np.linalg.norm(base))

    assert cos(reduced) > 0.3
    from dedloc_pipeline.compute import robust
    rows = np.stack(honest + [codec.decode(codec.encode(-base, run.config.codec, run.config.block_size),
                                           run.config.codec, run.config.block_size)] * 4)
    assert cos(robust.aggregate(rows, [8, 8, 8] + [50] * 4, run.config)) < 0


# case 27: a volunteer fills its own prefix

@pytest.mark.parametrize("junk", [False, True])
def test_a_prefix_filled_past_its_bound_is_left_out_until_pruned(make_run, caplog, junk):
    """Inside its prefix a volunteer may write anything (R2 cannot narrow it), for instance a
    flood of keys each poll would list. A prefix holding more than ``per_volunteer`` keys is not
    read at all, and logged once: the round closes from the others, the listing pages on after
    it, and the commit's pruning deletes the keys off the layout. The control: the same
    volunteer without the flood counts."""
    run = make_run()
    keys = {p: _upload(run, 0, p, samples=12) for p in ("a", "b", "mallory")}
    if junk:
        for i in range(run.per_volunteer + 1):
            run.bucket.write_bytes(f"{run.keys.volunteer_dir('mallory')}/junk/{i}", b"x")
    sched = Scheduler(run, 1, 0)
    with caplog.at_level(logging.ERROR, logger="dedloc_pipeline.organizer.scheduler"):
        close = sched.try_close(0)
        sched.try_close(0)
    accepted = sorted(e.peer for e in close.accepted)
    assert accepted == (["a", "b"] if junk else ["a", "b", "mallory"])
    said = [r.message for r in caplog.records if "prefix holds more" in r.message]
    assert len(said) == int(junk) and all("mallory" in m for m in said)
    finish(run, 0)
    assert not [k for k in run.bucket.find(run.keys.volunteer_dir("mallory")) if "/junk/" in k]
    assert run.bucket.exists(run.keys.manifest(keys["mallory"]))  # the rounds still kept stay
