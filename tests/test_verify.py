"""Verified work: recomputed shards on a tiny run in a local bucket, honest ones and attacks."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.checks import catalog, flags, recompute, verify
from dedloc_pipeline.cli import app
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import shard
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.storage import codec, vector
from dedloc_pipeline.testing import collaborate
from dedloc_pipeline.trust import identity
from dedloc_pipeline.volunteer.worker import Worker

PEERS = [("a", 4), ("b", 3), ("c", 5)]


def finish(run, r):
    sched = Scheduler(run, 1, 0)
    assert sched.try_close(r) is not None
    with ThreadPoolExecutor(2) as pool:
        return sched.finish(r, pool)


def honest_upload(run, peer, signer=None):
    """A real worker alone (no scheduler yet): it computes until its own samples fill the round,
    then uploads one shard."""
    w = Worker(run, peer, micro_batch=4, threads=1, delayed=False, poll_s=0, signer=signer)
    while not w.uploads:
        w.step()
        w.flush()
    w.leave()
    return w.uploads[0][1]


def gradient_of(run, stream, start, count, r=0):
    """The mean gradient of samples [start, start+count) of ``stream`` on state r."""
    entry = shard.Entry.model_construct(round=r, samples=count, stale_samples=0,
                                        data=shard.DataRef(stream=stream, ranges=[(start, count)]))
    return recompute.Recomputer(run, "cpu").gradient(entry)


def forged(run, peer, grad, samples, ranges, r=0, signer=None, arrays=None):
    """A shard whose manifest claims ``ranges`` of ``peer``'s stream, whatever ``grad`` is."""
    arrays = arrays or codec.encode(grad, run.config.codec, run.config.block_size)
    return shard.upload(run, r, peer, "0001", arrays, samples, 5.0, shard.DataRef(stream=peer, ranges=ranges),
                        signer=signer)


def verdicts(record):
    return {v["peer"]: v for v in record["shards"]}


@pytest.mark.parametrize("codec_name,delayed", [("int8", True), ("none", False)])
@pytest.mark.slow
def test_honest_shards_verify(make_run, codec_name, delayed):
    """Every shard of a real collaboration, recomputed: int8 with the workers' error feedback and
    one-step-stale samples (computed on the state before), and exact fp32 to a far tighter bound."""
    run = make_run(codec=codec_name, delayed_updates=delayed, keep_states=10)
    collaborate(run, PEERS, rounds=3)
    v = verify.Verifier(run, fraction=1.0, device="cpu")
    assert v.serve(until_round=2) == 3
    records = [run.bucket.read_json(run.keys.verdicts(r)) for r in range(3)]
    shards = [s for rec in records for s in rec["shards"]]
    assert len(shards) == sum(rec["accepted"] for rec in records) >= 9
    assert all(s["verdict"] == "ok" and not s["flag"] for s in shards), shards
    if delayed:
        assert any(s["stale_samples"] for s in shards)  # the stale part was recomputed on state r-1
    worst = min(s["cosine"] for s in shards)
    assert worst > (1 - 1e-9 if codec_name == "none" else recompute.TOLERANCES["int8"].min_cosine)
    assert flags.read(run) == {}


def test_stale_samples_are_recomputed_on_the_previous_state(make_run):
    """The control of the stale split: claiming the stale part was computed on the shard's own
    state (stale_samples 0) makes the same gradient a mismatch at fp32's tolerance."""
    run = make_run(codec="none", delayed_updates=True, keep_states=10)
    collaborate(run, PEERS, rounds=2)
    rec = recompute.Recomputer(run, "cpu")
    entry = next(s for s in Close.read(run, 1).accepted if s.stale_samples)
    grad = recompute.read_shard(run, entry)
    assert recompute.compare(grad, rec.gradient(entry)).matches(recompute.TOLERANCES["none"])
    assert not recompute.compare(grad, rec.gradient(entry.model_copy(update={"stale_samples": 0}))).matches(
        recompute.TOLERANCES["none"])


def test_the_choice_follows_the_next_commit(make_run):
    """Recomputable by anyone from COMMIT r+1; another COMMIT draws other shards."""
    run = make_run(keep_states=10)
    collaborate(run, PEERS, rounds=1)
    close, commit = Close.read(run, 0), run.commit_of(1)
    h = shard.commit_hash(commit)
    record = verify.Verifier(run, fraction=0.3, device="cpu").verify_round(0)
    assert [s["key"] for s in record["shards"]] == sorted(s.key for s in verify.chosen(close.accepted, h, 0.3))
    assert record["state_hash"] == h
    many = [s.model_copy(update={"key": f"{s.key}-{i}"}) for s in close.accepted for i in range(100)]
    picked = {s.key for s in verify.chosen(many, h, 0.05)}
    assert picked == {s.key for s in verify.chosen(many, h, 0.05)}
    assert 0 < len(picked) < 0.15 * len(many)
    other = shard.commit_hash(dict(commit, committed_at=commit["committed_at"] + 1))
    assert picked != {s.key for s in verify.chosen(many, other, 0.05)}
    assert len(verify.chosen(many[:3], h, 0.0)) == 1  # at least one a round


@pytest.mark.slow
def test_a_restarted_verifier_does_not_redo_a_round(make_run):
    run = make_run(keep_states=10)
    collaborate(run, PEERS, rounds=2)
    first = verify.Verifier(run, fraction=1.0, device="cpu")
    assert first.serve(until_round=0) == 1
    again = verify.Verifier(run, fraction=1.0, device="cpu")
    calls = []
    gradient = again.recompute.gradient
    again.recompute.gradient = lambda entry: calls.append(entry.key) or gradient(entry)
    assert again.next_round() == 1
    assert again.serve(until_round=1) == 2
    assert calls and all(run.keys.shard_parts(k)[0] == 1 for k in calls)  # round 1 only
    assert again.verify_round(0) == run.bucket.read_json(run.keys.verdicts(0))


@pytest.mark.slow
def test_one_unreadable_shard_does_not_skip_the_copy_screen_for_the_others(make_run):
    """mallory copies alice's codes; bob's frozen copy is then gone. The screen still pairs
    mallory with alice and flags mallory; bob is listed as unreadable, screening nobody (the
    first report: one such shard skipped the screen of the whole round, for every volunteer)."""
    run = make_run(codec="int8", target_batch_size=72, keep_states=10)
    alice = honest_upload(run, "alice")
    entry = catalog.validate(run, 0, alice, run.bucket.read_bytes(run.keys.manifest(alice)))
    arrays = vector.read_vector(run.bucket, alice, run.grad_format, checksums=entry.checksums, raw=True)
    forged(run, "mallory", None, entry.samples, [(0, entry.samples)], arrays=arrays)
    bob = honest_upload(run, "bob")
    finish(run, 0)
    run.bucket.delete(run.keys.frozen(bob))
    record = verify.Verifier(run, fraction=0.0, at_least=0, device="cpu").verify_round(0)
    assert record["copy_screen"]["unreadable"] == [bob]
    mallory = verdicts(record)["mallory"]["key"]
    assert [p["shards"] for p in record["copy_screen"]["pairs"]] == [sorted([alice, mallory])]
    assert verdicts(record)["mallory"]["verdict"] == "copy" and list(flags.read(run)) == ["mallory"]


def test_a_round_whose_state_was_pruned_is_skipped(make_run, caplog):
    """keep_states 2: after state 4, states 1 and 2 and rounds 0 and 1 are gone. Round 1 is
    recorded as skipped, never a crash, and its log line and the validator's tally count it so
    (the first report: "2 shards recomputed" for a round whose every shard was skipped); round 3,
    still whole, verifies (the control)."""
    run = make_run(keep_states=2, delayed_updates=False)
    collaborate(run, PEERS, rounds=4)
    v = verify.Verifier(run, fraction=1.0, device="cpu")
    with caplog.at_level(logging.INFO, logger="dedloc_pipeline.checks.verify"):
        pruned, whole = v.verify_round(1), v.verify_round(3)
    n = len(pruned["shards"])
    assert n and all(s["verdict"] == "skipped" and not s["flag"] for s in pruned["shards"])
    assert pruned["shards"][0]["reason"].startswith("skipped: ") and "pruned" in pruned["shards"][0]["reason"]
    assert sorted(pruned["copy_screen"]["unreadable"]) == sorted(s["key"] for s in pruned["shards"])
    assert whole["shards"] and all(s["verdict"] == "ok" for s in whole["shards"])
    lines = [r.getMessage() for r in caplog.records if "verified:" in r.getMessage()]
    m = len(whole["shards"])
    assert lines == [f"round 1 verified: 0 shards recomputed, 0 flagged, {n} skipped (pruned), 0 unverified",
                     f"round 3 verified: {m} shards recomputed, 0 flagged, 0 skipped (pruned), 0 unverified"]
    assert dict(v.tally) == {"recomputed": m, "flagged": 0, "skipped": n, "unverified": 0}
    # the last line says what was checked; where nothing was, it says so and why (the report:
    # "verified up to round 5" after every round was skipped)
    assert verify.ended(3, v.tally).startswith(f"verified up to round 3: {m} shards recomputed")
    assert verify.ended(1, verify.counts(pruned["shards"])) == (
        f"nothing verified up to round 1 (0 shards recomputed, 0 flagged, {n} skipped (pruned), 0 unverified): the "
        "states its shards were computed on were pruned before it read them: run it beside the scheduler, or keep "
        "more states (keep_states)")


def test_claims_the_validator_cannot_recompute(make_run):
    """Stale samples in round 0 (there is no earlier state) are the volunteer's fault."""
    run = make_run(codec="none", target_batch_size=24, keep_states=10)
    grad = gradient_of(run, "mallory", 0, 8)
    key = forged(run, "mallory", grad, 8, [(0, 8)])
    m = run.bucket.read_json(run.keys.manifest(key))
    run.bucket.write_json(run.keys.manifest(key), dict(m, stale_samples=4))
    honest_upload(run, "alice")
    finish(run, 0)
    got = verdicts(verify.Verifier(run, fraction=1.0, device="cpu").verify_round(0))
    assert got["mallory"]["verdict"] == "mismatch" and "round 0" in got["mallory"]["reason"]
    assert list(flags.read(run)) == ["mallory"]


def test_a_flagged_volunteer_is_revoked_with_the_organizers_key(tmp_path, bucket):
    from dedloc_pipeline.protocol.run import init_run

    from .conftest import small_config
    org = identity.generate(tmp_path / "org.pem")
    cfg = small_config(organizer_key=identity.public(org), codec="int8", keep_states=10)
    run = init_run(bucket, cfg, organizer=org)
    keys = {n: identity.generate(tmp_path / f"{n}.pem") for n in ("alice", "bob", "mallory")}
    identity.update_roster(bucket, run.name, org, enroll={n: identity.public(k) for n, k in keys.items()})
    forged(run, "mallory", gradient_of(run, "mallory", 100, 8), 8, [(0, 8)], signer=keys["mallory"])
    honest_upload(run, "alice", signer=keys["alice"])
    honest_upload(run, "bob", signer=keys["bob"])
    finish(run, 0)
    verify.Verifier(run, fraction=1.0, device="cpu", revoke=True).verify_round(0)
    roster = identity.read_roster(bucket, run.name, run.config.organizer_key)
    assert roster.revoked == [identity.public(keys["mallory"])]
    with pytest.raises(identity.IdentityError, match="revoked"):
        roster.key_of("mallory")
    assert roster.key_of("alice") == identity.public(keys["alice"])


@pytest.mark.slow
def test_the_verify_command(make_run):
    run = make_run(keep_states=10)
    collaborate(run, PEERS, rounds=2)
    res = CliRunner().invoke(app, ["verify", "--bucket", run.bucket.url, "--run", run.name, "--fraction", "1",
                                   "--until-round", "1", "--device", "cpu", "--poll", "0"])
    assert res.exit_code == 0, res.output
    assert "verified up to round 1: " in res.output and "0 flagged, 0 skipped (pruned), 0 unverified" in res.output
    keys = run.keys
    assert all(s["verdict"] == "ok" for r in range(2) for s in run.bucket.read_json(keys.verdicts(r))["shards"])
