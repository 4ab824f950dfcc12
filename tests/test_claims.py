"""Everything a volunteer writes is a claim (issue 15): sample counts, data references, parts,
and, where a store cannot keep volunteers out of them, the organizer's own records. Each attack
below is a case of docs/faults.md, with a control showing what it did without its defence."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dedloc_pipeline.checks import admission, direction, flags, verify
from dedloc_pipeline.compute import aggregation
from dedloc_pipeline.model.data import DataError, make_source
from dedloc_pipeline.monitoring.volunteer import make_worker
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import shard, view
from dedloc_pipeline.protocol.close import round_close
from dedloc_pipeline.protocol.run import Run, RunError, init_run
from dedloc_pipeline.storage import codec, vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import on_clock, stream_next
from dedloc_pipeline.trust import identity, pins

from .conftest import small_config


def _noise(run, seed, scale=1e-3):
    return np.random.default_rng(seed).standard_normal(run.flat.n).astype(np.float32) * scale


def _shard(run, r, peer, grad, samples, start=None, part="0001", ranges=None, signer=None, loss=5.0):
    start = stream_next(run, r, peer) if start is None else start
    return shard.upload(run, r, peer, part, codec.encode(grad, run.config.codec, run.config.block_size),
                        samples, loss, shard.DataRef(stream=peer, ranges=ranges or [(start, samples)]),
                        signer=signer, inner_steps=[samples] if run.config.algorithm == "diloco" else None)


def _finish(run, r):
    with ThreadPoolExecutor(2) as pool:
        return Scheduler(run, 2, 0).finish(r, pool)


def _cos(x, y):
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


# case 14: claimed samples

def test_a_claimed_batch_counts_for_at_most_twice_the_median_volunteer(make_run):
    """Mallory's 8-sample gradient, reversed, claims 96 samples (4 target batches: the most one
    shard may claim). Uploaded first, it does not close the round alone; counted, it weighs as
    twice the median volunteer at most, and the committed step still points the honest way.
    Control: weighted by the claim (the old mean), it takes 80% of the mean and the step points
    mallory's way."""
    run = make_run(norm_screen=None, max_grad_norm=1e12)
    base = _noise(run, 0)
    for i, p in enumerate("abc"):
        _shard(run, 0, p, base + _noise(run, 1 + i, 2e-4), 8)
    assert Scheduler(run, 1, 0).try_close(0).samples == 24
    _finish(run, 0)

    _shard(run, 1, "mallory", -base, 96)
    sched = Scheduler(run, 1, 0)
    assert sched.try_close(1) is None, "one claim filled a round alone"
    honest = [base + _noise(run, 10 + i, 2e-4) for i in range(3)]
    for p, g in zip("abc", honest):
        _shard(run, 1, p, g, 8)
    close = sched.try_close(1)
    weight = {s.peer: s.weight for s in close.accepted}
    assert weight["mallory"] == 16 and all(weight[p] == 8 for p in "abc")  # twice the median volunteer
    assert close.samples == 16 + 24
    _finish(run, 1)
    reduced = vector.read_vector(run.bucket, run.keys.reduced(1), run.dense_format)
    assert _cos(reduced, base) > 0.3
    # control: the claim as the weight
    claimed = {s.peer: s.samples for s in close.accepted}
    assert claimed["mallory"] / sum(claimed.values()) == 0.8
    by_claim = sum(claimed[p] * g for p, g in zip("abc", honest)) - claimed["mallory"] * base
    assert _cos(by_claim, base) < 0


def test_a_first_claim_in_a_signed_runs_first_round_is_capped(tmp_path, bucket):
    """Round 0 builds on no contributors: mallory's 8 samples claiming 96, in before anyone's
    heartbeat, count as one of the three enrolled volunteers (16 of 24) and do not close the
    round. A volunteer truly alone fills it once ``peer_timeout_s`` has passed since its first
    work. Control: weighed among those present only (the rule before), the claim fills the round
    at once."""
    org = identity.generate(tmp_path / "org.pem")
    keys = {p: identity.generate(tmp_path / f"{p}.pem") for p in ("mallory", "alice", "bob")}
    run = on_clock(init_run(bucket, small_config(organizer_key=identity.public(org), norm_screen=None,
                                                 max_grad_norm=1e12), organizer=org))
    identity.update_roster(bucket, run.name, org, enroll={p: identity.public(k) for p, k in keys.items()})
    _shard(run, 0, "mallory", -_noise(run, 0), 96, signer=keys["mallory"])
    sched = Scheduler(run, 1, 0)
    assert sched.try_close(0) is None, "one claim filled a run's first round alone"
    assert run.bucket.read_json(run.keys.view)["cap"] == 16  # 2 x 24 / 3
    entries, _ = sched.judge.verdicts(0)
    assert admission.weigh(entries, 24, 0.1).samples == 96  # the control: among those present only
    run.clock.advance(run.config.peer_timeout_s)
    close = sched.try_close(0)
    assert close is not None and close.samples == 96, "a volunteer alone never fills its round"


def test_the_round_loss_is_the_median_volunteers(make_run):
    """A loss is a claim: of four volunteers, one reports -1e30 (refused: a cross-entropy is never
    negative) and one 1e30; what COMMIT, status and the report print is the median volunteer's,
    between the two honest ones. Control: the weighted mean of the claims is above 3e29."""
    run = make_run()
    _shard(run, 0, "mallory", _noise(run, 0), 8, loss=-1e30)
    for i, (p, loss) in enumerate(zip("ab", (5.0, 5.2))):
        _shard(run, 0, p, _noise(run, 1 + i), 8, loss=loss)
    _shard(run, 0, "carol", _noise(run, 3), 8, loss=1e30)
    close = Scheduler(run, 1, 0).try_close(0)
    assert {e.peer for e in close.accepted} == {"a", "b", "carol"}
    assert [e.reason for e in close.rejected] == ["impossible loss -1e+30"]
    assert _finish(run, 0)["loss"] == 5.2  # the median of 5.0, 5.2 and 1e30
    assert sum(e.weight * e.loss for e in close.accepted) / close.samples > 3e29  # the control


def test_a_refused_volunteers_heartbeat_stops_counting_in_that_round(make_run):
    """Pending samples are a claim too: once a shard of mallory's round is refused, her heartbeat
    no longer counts toward the round (nor her as present), so it cannot make the others upload
    early for a round her shards will not fill. Control: before her shard lands it counts."""
    import time

    run = make_run(target_batch_size=48)
    sched, now = Scheduler(run, 1, 0), time.time()

    def beat(peer, samples):
        run.bucket.write_json(run.keys.progress(0, peer), {"peer": peer, "round": 0, "samples": samples,
                                                           "sending": 0, "samples_per_s": 0.0, "time": now})

    beat("a", 4)
    beat("mallory", 40)
    assert sched.try_close(0, now=now) is None
    assert view.read(run.bucket, run.keys).pending_samples == 44  # the control
    _shard(run, 0, "mallory", _noise(run, 0), 8, loss=-1.0)
    beat("mallory", 40)
    assert sched.try_close(0, now=now) is None
    v = view.read(run.bucket, run.keys)
    assert v.pending_samples == 4 and v.rejected == 1, v


@pytest.mark.parametrize("when", ["before_close", "after_close"])
def test_a_shard_rewritten_after_validation_changes_nothing(make_run, when):
    """The scheduler copies each shard into a prefix only the organizer writes (``frozen/``)
    and validates the copy, which aggregators and the validator read. A volunteer rewriting a
    chunk of its own shard after it was validated, before or after CLOSE, changes nothing: the
    round commits the state of the validated bytes, and the validator recomputes the shard (not
    "skipped ... pruned"). Control: the original now fails its checksums, which stalled the
    round for good when aggregators read it."""
    run = make_run(target_batch_size=8)
    honest = _noise(run, 0)
    key = _shard(run, 0, "a", honest, 8)
    sched = Scheduler(run, 1, 0)
    chunk = f"{key}/{sorted(vector.chunk_objects(run.grad_format))[0]}"
    if when == "before_close":
        assert sched.judge.verdicts(0)[0]  # validated, the round not closed yet
    else:
        assert sched.try_close(0) is not None
    run.bucket.write_bytes(chunk, b"\x00" * 64)  # the volunteer's own key: its credential may write it
    if when == "before_close":
        assert sched.try_close(0) is not None
    with pytest.raises(vector.CorruptShard, match="checksum mismatch|undecodable"):  # the control
        vector.read_vector(run.bucket, key, run.grad_format, checksums=round_close(run, 0).accepted[0].checksums)
    _finish(run, 0)
    reduced = vector.read_vector(run.bucket, run.keys.reduced(0), run.dense_format)
    assert np.array_equal(reduced, honest)  # the exact codec: the validated gradient itself
    record = verify.Verifier(run, fraction=1.0).verify_round(0)
    assert record["shards"][0]["verdict"] in ("ok", "mismatch")  # recomputed from the frozen copy (noise here)


@pytest.mark.parametrize("attack", ["reversed_x8", "reversed"])
def test_in_the_local_steps_mode_a_shard_pointing_away_from_the_median_volunteer_is_rejected(make_run, attack):
    """A diloco shard is not recomputed before CLOSE, and at 8x the median norm a reversed one
    passes the norm screen (10x). Sketched as it is validated, it is compared with the median volunteer and
    rejected; the three honest volunteers, whose pseudo-gradients share a direction through their
    noise, are not. Control: counted, the mean would point the attacker's way (and with the
    default algorithm, shards carry no sketch: the validator recomputes them instead)."""
    run = make_run(algorithm="diloco", codec="int8", target_batch_size=24, max_grad_norm=1e12,
                   close={"probe_samples": None})  # shards of noise: the direction screen alone
    base = _noise(run, 0)
    honest = [base + _noise(run, 1 + i, 2e-3) for i in range(3)]  # cosine about 0.45 with base
    for p, g in zip("abc", honest):
        _shard(run, 0, p, g, 8)
    _shard(run, 0, "mallory", -(8.0 if attack == "reversed_x8" else 1.0) * base, 8)
    close = Scheduler(run, 1, 0).try_close(0)
    assert close is not None and sorted(e.peer for e in close.accepted) == ["a", "b", "c"]
    assert [r.reason.split(":")[0] for r in close.rejected] == ["points away from the round's median volunteer"]
    _finish(run, 0)
    assert _cos(vector.read_vector(run.bucket, run.keys.reduced(0), run.dense_format), base) > 0.5
    sched = Scheduler(run, 1, 0)
    entries, _ = sched.judge.verdicts(0)
    kept, out = admission.direction_screen(entries, None)  # the control: nothing screened
    assert len(kept) == 4 and not out
    counted = sum(codec.decode(vector.read_vector(run.bucket, run.keys.frozen(e.key), run.grad_format, raw=True),
                               "int8", run.config.block_size) for e in kept)
    if attack == "reversed_x8":
        assert _cos(counted, base) < 0
    plain = make_run(run="plain", target_batch_size=8)
    _shard(plain, 0, "a", base, 8)
    assert Scheduler(plain, 1, 0).judge.verdicts(0)[0][0]._sketch is None


def test_a_late_local_steps_shard_is_sketched_again_on_the_round_it_is_folded_into(make_run, monkeypatch):
    """Each round sketches other chunks (here: round 0 chunks 0-1, round 1 chunks 2-3), so a late
    shard of round 0 folded into round 1 is sketched again on round 1's chunks: reversed, it is
    rejected there like any other. Control: its round-0 sketch is of other coordinates, nearly
    orthogonal to round 1's median, so the screen could not have judged it."""
    monkeypatch.setattr(direction, "sampled", lambda n, r: [2 * (r % 2), 2 * (r % 2) + 1])
    run = make_run(algorithm="diloco", codec="int8", target_batch_size=24, max_grad_norm=1e12,
                   chunk_size=65536, close={"late_shards": "fold", "probe_samples": None})  # shards of noise
    assert run.grad_format.n_chunks >= 4
    base = _noise(run, 0)
    for i, p in enumerate("abc"):
        _shard(run, 0, p, base + _noise(run, 1 + i, 2e-3), 8)
    sched = Scheduler(run, 1, 0)
    assert sched.try_close(0) is not None
    _finish(run, 0)
    _shard(run, 0, "mallory", -8 * base, 8)  # late for round 0
    for i, p in enumerate("abc"):
        _shard(run, 1, p, base + _noise(run, 10 + i, 2e-3), 8)
    close = sched.try_close(1)
    assert sorted(e.peer for e in close.accepted) == ["a", "b", "c"]
    assert [(run.keys.shard_parts(r.key)[1], r.reason.split(":")[0]) for r in close.rejected] == [
        ("mallory", "points away from the round's median volunteer")]
    first = sched.judge.verdicts(0, skip=round_close(run, 0).listed())[0][0]._sketch  # the control
    median = np.median(np.stack([e._sketch for e in sched.judge.verdicts(1)[0]]), axis=0)
    assert abs(first @ median) / (np.linalg.norm(first) * np.linalg.norm(median)) < 0.1


def test_honest_volunteers_within_twice_their_share_keep_their_weights(make_run):
    """Uneven honest volunteers (4, 8 and 12 of 24) are not capped: N peers still equal one process."""
    run = make_run()
    for i, (p, n) in enumerate(zip("abc", (4, 8, 12))):
        _shard(run, 0, p, _noise(run, i), n)
    close = Scheduler(run, 1, 0).try_close(0)
    assert all(s.weight == s.samples for s in close.accepted) and close.samples == 24


# case 15: data references

@pytest.mark.parametrize("attack,reason", [
    ("far_ahead", "more than"),
    ("reused", "already counted up to 8"),
    ("gapped", "not one contiguous run"),
    ("other_stream", "a volunteer counts only its own stream"),
    ("copied_part", "already counted this round by another part"),
    ("huge_claim", "more than a shard can hold"),
])
def test_a_shard_names_a_contiguous_run_of_its_own_stream(make_run, attack, reason):
    """After round 0 counted a's samples 0..8, round 1's shards of a must start at 8 and run on
    without gaps, within its stream's window, in a's stream, and no two parts may name the same
    samples (a copy of one's own part would count its weight twice). Control: the honest
    continuation is accepted in the same round."""
    run = make_run(target_batch_size=8)
    _shard(run, 0, "a", _noise(run, 0), 8)
    assert Scheduler(run, 1, 0).try_close(0)
    _finish(run, 0)
    assert run.stream_ends(1) == {"a": 8}
    good = _shard(run, 1, "a", _noise(run, 1), 8, start=8)
    g = _noise(run, 2)
    if attack == "far_ahead":  # a stream sent to 10^9: once its restart would jump there
        bad = _shard(run, 1, "a", g, 4, start=10 ** 9, part="0002")
    elif attack == "reused":
        bad = _shard(run, 1, "a", g, 4, start=0, part="0002")
    elif attack == "gapped":  # cherry-picked samples
        bad = _shard(run, 1, "a", g, 4, part="0002", ranges=[(16, 2), (40, 2)])
    elif attack == "huge_claim":  # over 4 target batches: more than any worker holds, and unverifiable
        bad = _shard(run, 1, "a", g, 33, start=16, part="0002")
    elif attack == "other_stream":
        key = run.keys.shard(1, "a", "0002")
        bad = shard.upload(run, 1, "a", "0002", codec.encode(g, "none", run.config.block_size), 4, 5.0,
                           shard.DataRef(stream="b", ranges=[(0, 4)]))
        assert bad == key
    else:
        bad = _shard(run, 1, "a", g, 4, start=8, part="0002")
    close = Scheduler(run, 1, 0).try_close(1)
    assert [s.key for s in close.accepted] == [good]
    (rejected,) = close.rejected
    assert rejected.key == bad and reason in rejected.reason


def test_refused_samples_still_advance_their_stream(make_run):
    """A shard refused after its manifest proved its own (here: its chunk is not the one its
    checksums name) spends its samples: the stream's next shard starts after them, and is not
    refused for the gap. (Values out of bounds would flag its volunteer: tests/test_checks.py.)"""
    run = make_run(target_batch_size=8)
    _shard(run, 0, "a", _noise(run, 0), 8)
    bad = _shard(run, 0, "a", _noise(run, 1), 8, part="0002")
    chunk = f"{bad}/values/c/0"
    run.bucket.write_bytes(chunk, run.bucket.read_bytes(f"{run.keys.shard(0, 'a', '0001')}/values/c/0"))
    close = Scheduler(run, 1, 0).try_close(0)
    assert len(close.accepted) == 1 and "checksum" in close.rejected[0].reason
    _finish(run, 0)
    assert run.stream_ends(1) == {"a": 16}


# case 16: the organizer's records

@pytest.fixture
def signed_run(tmp_path, bucket):
    org = identity.generate(tmp_path / "org.pem")
    mallory = identity.generate(tmp_path / "mallory.pem")
    run = init_run(bucket, small_config(organizer_key=identity.public(org), target_batch_size=8), organizer=org)
    alice = identity.generate(tmp_path / "alice.pem")
    identity.update_roster(bucket, run.name, org, enroll={"alice": identity.public(alice)})
    return run, org, alice, mallory


@pytest.mark.parametrize("signer", ["unsigned", "mallory"])
def test_forged_organizer_records_are_refused(signed_run, caplog, signer):
    """CLOSE, COMMIT, LATEST and streams carry the organizer's signature: written by anyone else
    (R2 cannot keep a volunteer out of them), they are refused with a clear error, and the
    scheduler replaces what it can. Control: in an unsigned run the same forgeries are believed."""
    run, org, alice, mallory = signed_run
    b, k = run.bucket, run.keys

    def forge(body):
        return body if signer == "unsigned" else identity.sign_record(mallory, body)

    # a CLOSE created before the scheduler's, accepting nothing: deleted, the round closes for real
    b.create_json(k.close(0), forge({"round": 0, "samples": 8, "accepted": [], "rejected": []}))
    with pytest.raises(identity.IdentityError, match="CLOSE of round 0 is not signed"):
        aggregation.reduce_part(run, 0, 0)
    _shard(run, 0, "alice", _noise(run, 0), 8, signer=alice)
    with caplog.at_level(logging.ERROR):
        close = Scheduler(run, 1, 0).try_close(0)
    assert [s.peer for s in close.accepted] == ["alice"] and "deleted" in caplog.text
    # a COMMIT of state 1 created before the organizer's: no state to anyone, then replaced
    b.create_json(k.commit(1), forge(dict(run.commit_of(0), state=1)))
    assert run.latest() == 0
    with pytest.raises(identity.IdentityError, match="COMMIT of state 1 is not signed"):
        run.commit_of(1)
    assert _finish(run, 0)["contributors"] == ["alice"] and run.latest() == 1
    # LATEST pointing far ahead, and streams sending alice's stream back to 0
    b.write_json(k.latest, forge({"state": 99}))
    b.write_json(k.streams(1), forge({"state": 1, "ends": {"alice": 0}}))
    fresh = Run(b, run.name)
    assert fresh.latest_hint() == 1 and fresh.latest() == 1
    assert fresh.stream_ends(1) == {}
    # control: an unsigned run believes all of it
    plain = init_run(b, small_config(run="plain", target_batch_size=8))
    b.write_json(plain.keys.latest, {"state": 99})
    assert plain.latest_hint() == 99


def test_genuine_records_copied_to_another_place_are_refused(signed_run, caplog, tmp_path):
    """A signature proves who wrote a record, not where: each signed record names its run and its
    place, and readers check both. The organizer's CLOSE of round 0 copied to round 1 (its gradient
    applied twice), its COMMIT of state 1 copied to state 2 (the model frozen while the run looks
    healthy) and another run's flag of alice (same organizer key) are refused; the scheduler
    replaces the copies with the true records. Control: each copy carries a valid signature."""
    run, org, alice, mallory = signed_run
    b, k = run.bucket, run.keys
    _shard(run, 0, "alice", _noise(run, 0), 8, signer=alice)
    Scheduler(run, 1, 0).try_close(0)
    _finish(run, 0)
    b.create_json(k.close(1), b.read_json(k.close(0)))
    b.create_json(k.commit(2), b.read_json(k.commit(1)))
    for copied in (k.close(1), k.commit(2)):  # the control: genuine signatures
        identity.check_record(run.config.organizer_key, b.read_json(copied), copied)
    with pytest.raises(identity.IdentityError, match="CLOSE of round 1 is a signed record of round 0, not 1"):
        aggregation.reduce_part(run, 1, 0)
    with pytest.raises(identity.IdentityError, match="COMMIT of state 2 is a signed record of state 1, not 2"):
        run.commit_of(2)
    assert run.latest() == 1
    _shard(run, 1, "alice", _noise(run, 1), 8, signer=alice)
    with caplog.at_level(logging.ERROR):
        close = Scheduler(run, 1, 0).try_close(1)
    assert close.round == 1 and [s.peer for s in close.accepted] == ["alice"] and "deleted" in caplog.text
    assert _finish(run, 1)["round"] == 1 and run.commit_of(2)["contributors"] == ["alice"]
    # a flag the same organizer signed in another run
    other = Run(b, "other", small_config(run="other", organizer_key=run.config.organizer_key), organizer=org)
    flag = other.record("flag of alice", {"volunteer": "alice", "peer": "alice", "round": 0, "verdict": "mismatch",
                                          "reason": "differs", "flagged_at": 0.0}, volunteer="alice")
    b.create_json(k.flag("alice"), flag)
    with caplog.at_level(logging.WARNING):
        assert flags.read(run) == {}
    assert "a signed record of run 'other', not 'test'" in caplog.text
    b.write_json(k.flag("alice"), run.record("flag of alice", dict(flag, run=run.name), volunteer="alice"))
    assert list(flags.read(run)) == ["alice"]  # the control: this run's own flag counts


def test_stop_and_the_round_view_count_only_from_the_organizer(signed_run, caplog):
    """On R2 any volunteer can write STOP.json and VIEW.json. In a signed run both are signed: a
    STOP not the organizer's is ignored by every reader and deleted by the scheduler, and the
    organizer's stands; a view saying the round is closed and the run stopped, signed by mallory,
    is no view to a worker (it holds nothing back for it), while the scheduler's is read. Control:
    an unsigned run believes both."""
    run, org, alice, mallory = signed_run
    b, k = run.bucket, run.keys
    b.create_json(k.stop(), identity.sign_record(mallory, {"run": run.name, "reason": "mallory"}))
    assert not run.stopped()
    with caplog.at_level(logging.ERROR):
        assert Scheduler(run, 1, 0).poll().stopped is False
    assert not b.exists(k.stop()) and "STOP is not signed" in caplog.text  # deleted
    sched = Scheduler(run, 1, 0)
    assert sched.try_close(0) is None  # publishes the round view
    reader = view.Reader(30.0, 60.0, organizer_key=run.config.organizer_key)
    assert reader.read(b, k).round == 0
    forged = view.View(state=0, round=0, target=8, validated_samples=8, closed=True, stopped=True, at=0.0,
                       written_at=0.0)
    view.write(b, k, forged, lambda what, body: identity.sign_record(mallory, dict(body, run=run.name)))
    assert reader.read(b, k) is None
    assert view.Reader(30.0, 60.0).read(b, k).stopped  # the control: read as an unsigned run would
    assert run.stop("the organizer's") and run.stopped() and Scheduler(run, 1, 0).poll().stopped
    plain = init_run(b, small_config(run="plain", target_batch_size=8))
    b.create_json(plain.keys.stop(), {"reason": "anyone"})
    assert plain.stopped()  # the control: unsigned, anyone's STOP counts


def test_a_rewritten_run_json_is_refused_by_the_volunteers_pin(signed_run, tmp_path):
    """run.json names the organizer key and is signed by it; a volunteer pins that key on first
    join (or is given it: ``--organizer``). A run.json edited without the key fails its signature;
    one naming mallory's key, signed by mallory, or naming none (a downgrade to an unsigned run),
    is refused against the pin, before any model is built. Control: a volunteer with no pin
    would believe mallory's run.json, which is self-consistent."""
    run, org, alice, mallory = signed_run
    b, k = run.bucket, run.keys
    genuine, key = b.read_json(k.config), run.config.organizer_key
    assert pins.check(b.url, run.name, key).startswith(f"run test: organizer key {key} pinned on first join")
    assert pins.check(b.url, run.name, key) is None  # pinned: nothing new to show
    b.write_json(k.config, dict(genuine, max_grad_norm=1e30))  # the norm bound lifted, the signature kept
    with pytest.raises(identity.IdentityError, match="run.json is not signed"):
        Run(b, run.name)
    theirs = identity.public(mallory)
    b.write_json(k.config, identity.sign_record(mallory, dict(genuine, organizer_key=theirs)))
    rewritten = Run(b, run.name)  # self-consistent: only a pin tells it from the organizer's
    assert rewritten.config.organizer_key == theirs
    with pytest.raises(identity.IdentityError, match="but this volunteer trusts .* a rewritten run.json is refused"):
        pins.check(b.url, run.name, theirs)
    with pytest.raises(identity.IdentityError, match="a rewritten run.json is refused"):
        make_worker(b.url, run.name)
    with pytest.raises(identity.IdentityError, match="names no organizer key"):
        pins.check(b.url, run.name, None)
    with pytest.raises(identity.IdentityError, match="given with --organizer"):
        pins.check("file:///elsewhere", run.name, theirs, given=key)
    assert pins.check("file:///another", run.name, theirs) is not None  # the control: no pin, believed


def test_a_scheduler_needs_the_organizer_key_to_close_a_signed_run(signed_run, monkeypatch):
    run, org, alice, mallory = signed_run
    monkeypatch.delenv("DEDLOC_ORGANIZER_KEY", raising=False)
    with pytest.raises(RunError, match="needs the organizer's private key"):
        Scheduler(Run(run.bucket, run.name))
    with pytest.raises(RunError, match="not the organizer key"):
        Run(run.bucket, run.name, organizer=mallory)


def _enrol_then_revoke_bob(run, org, tmp_path):
    """Bob enrolled (roster version 2), then revoked (3): bob's key, and version 2's bytes."""
    bob = identity.generate(tmp_path / "bob.pem")
    identity.update_roster(run.bucket, run.name, org, enroll={"bob": identity.public(bob)})
    before = run.bucket.read_bytes(run.keys.roster)
    identity.update_roster(run.bucket, run.name, org, revoke=["bob"])
    return bob, before


def test_a_roster_replayed_before_a_restart_is_refused(signed_run, tmp_path):
    """Bob is revoked (roster version 3), then the version-2 roster is written back over
    ROSTER.json, and only then is the scheduler (re)started: it starts from the roster history,
    so bob's shard is still refused. Control: without the history it would have been accepted."""
    run, org, alice, mallory = signed_run
    b, k = run.bucket, run.keys
    bob, before = _enrol_then_revoke_bob(run, org, tmp_path)
    b.write_bytes(k.roster, before)
    _shard(run, 0, "bob", _noise(run, 0), 8, signer=bob)
    sched = Scheduler(run, 1, 0)
    assert sched.judge.roster().version == 3
    assert sched.try_close(0) is None
    accepted, rejected = sched.judge.verdicts(0)
    assert not accepted and "revoked" in rejected[0].reason
    b.delete(k.rosters)  # control
    accepted, _ = Scheduler(run, 1, 0).judge.verdicts(0)
    assert [s.peer for s in accepted] == ["bob"]


def test_a_roster_history_rewound_below_the_newest_close_is_refused(signed_run, tmp_path):
    """Bob is revoked (version 3) and round 0 closes with it; then version 3 is deleted from the
    history and version 2 written back as ROSTER.json, and bob uploads. A restarted scheduler
    refuses to judge round 1 with version 2, naming the version to restore. Control: the history
    alone says version 2, in which bob is enrolled."""
    run, org, alice, mallory = signed_run
    b, k = run.bucket, run.keys
    bob, before = _enrol_then_revoke_bob(run, org, tmp_path)
    _shard(run, 0, "alice", _noise(run, 0), 8, signer=alice)
    assert Scheduler(run, 1, 0).try_close(0).roster == 3
    _finish(run, 0)
    b.delete(k.roster_version(3))
    b.write_bytes(k.roster, before)
    _shard(run, 1, "bob", _noise(run, 1), 8, signer=bob)
    with pytest.raises(RunError, match="newest roster in the bucket is version 2, but round 0 was closed with "
                                       "version 3.*Restore runs/test/roster/00000003.json"):
        Scheduler(run, 1, 0).try_close(1)
    newest = identity.newest_roster(b, run.name, run.config.organizer_key)  # the control
    assert newest.version == 2 and identity.public(bob) not in newest.revoked


def test_the_data_set_is_pinned_by_hash(bengali, tmp_path):
    """run.json pins DATA.json's hash: a card rewritten afterwards (it lists every shard and its
    hash) is refused by every peer. Control: the card as it was is read."""
    url, name = bengali
    copy = Bucket(f"file://{tmp_path}/copy")
    for key in Bucket(url).find(f"data/{name}"):
        copy.write_bytes(key, Bucket(url).read_bytes(key))
    run = init_run(copy, small_config("pinned", data=name))
    assert run.config.data_hash and make_source(run).card["seq_len"] == 32
    card = copy.read_json(f"data/{name}/DATA.json")
    card["splits"]["train"]["shards"] = card["splits"]["train"]["shards"][:1]
    copy.write_json(f"data/{name}/DATA.json", card)
    with pytest.raises(DataError, match="does not match the hash run.json pins"):
        make_source(Run(copy, "pinned"))


# case 17: what the validator caught

def test_the_scheduler_refuses_a_flagged_volunteers_later_shards(make_run):
    """Once the validator flagged mallory (verify.py), rounds opened after it admit none of her
    shards. Control: alice, not flagged, counts in the same round."""
    run = make_run(target_batch_size=8)
    flags.raise_flag(run, flags.Flag(volunteer="mallory", peer="mallory.gpu", round=0, verdict="mismatch",
                                     reason="differs", flagged_at=0.0))
    bad = _shard(run, 0, "mallory.gpu", _noise(run, 0), 8)
    good = _shard(run, 0, "alice", _noise(run, 1), 8)
    close = Scheduler(run, 1, 0).try_close(0)
    assert [s.key for s in close.accepted] == [good]
    assert close.rejected[0].key == bad and "flagged by the validator" in close.rejected[0].reason


def test_a_forged_flag_does_not_shut_out_an_honest_volunteer(signed_run, tmp_path):
    """In a signed run a flag counts only with the organizer's signature: anyone who can write
    there could otherwise flag every honest volunteer. Control: the organizer's flag counts."""
    run, org, alice, mallory = signed_run
    run.bucket.create_json(run.keys.flag("alice"), identity.sign_record(mallory, {"volunteer": "alice"}))
    _shard(run, 0, "alice", _noise(run, 0), 8, signer=alice)
    assert [s.peer for s in Scheduler(run, 1, 0).try_close(0).accepted] == ["alice"]
    _finish(run, 0)
    bob = identity.generate(tmp_path / "bob.pem")
    identity.update_roster(run.bucket, run.name, org, enroll={"bob": identity.public(bob)})
    sched = Scheduler(run, 1, 0)
    _shard(run, 1, "alice", _noise(run, 1), 4, signer=alice)
    _shard(run, 1, "bob", _noise(run, 2), 3, signer=bob)
    assert sched.try_close(1) is None
    # flagged mid-round: read again when the round is about to close, so alice stays out of it
    run.bucket.delete(run.keys.flag("alice"))  # the forged one, which the organizer's replaces
    flags.raise_flag(run, flags.Flag(volunteer="alice", peer="alice", round=0, verdict="mismatch", reason="differs",
                                     flagged_at=0.0))
    _shard(run, 1, "bob", _noise(run, 3), 5, signer=bob, part="0002")
    close = sched.try_close(1)
    assert [s.peer for s in close.accepted] == ["bob", "bob"]
    assert "flagged by the validator" in close.rejected[0].reason
