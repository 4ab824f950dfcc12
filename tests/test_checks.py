"""The checks' conformance suite: every check of ``checks/catalog.py`` is run through attacks it
must catch and a control it must let through, at its own moment.

A check gets its tests by declaring its attacks here: ``VALIDATION`` (a shard tampered with, then
judged as the scheduler judges it), ``AT_CLOSE`` (a round's entries) or, for the checks whose
attacks need a whole collaboration or a recomputation, ``ELSEWHERE`` (the attack-and-control
tests that run them). ``test_every_check_declares_its_attacks`` fails for a check that has none.
"""

from __future__ import annotations

import ast
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from dedloc_pipeline.checks import catalog
from dedloc_pipeline.checks.flags import Flag
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import shard
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.protocol.shard import DataRef, Entry, Rejected
from dedloc_pipeline.testing import small_config
from dedloc_pipeline.trust import identity

from .test_protocol import finish, put_shard

TESTS = Path(__file__).parent

# check -> (fault, what the rejection says): each fault tampers with one shard of a round
VALIDATION = {
    "manifest": [("bad_json", "malformed manifest"), ("truncated", "malformed manifest"),
                 ("zero_samples", "malformed manifest"), ("wrong_codec", "codec"), ("wrong_round", "round"),
                 ("wrong_peer", "peer")],
    "signature": [("unsigned", "unsigned shard"), ("forged", "signature does not match"),
                  ("not_enrolled", "is not enrolled")],
    "own stream": [("others_stream", "only its own stream")],
    "state": [("made_ahead", "state_hash")],  # computed before state 0's COMMIT existed: it cannot name its hash
    "claims": [("negative_loss", "impossible loss"), ("too_many_samples", "more than a shard can hold")],
    "stream": [("far_ahead", "past its stream's counted end")],
    "objects": [("missing_chunk", "missing chunk objects")],
    "contents": [("nan", "non-finite gradient"), ("huge", "gradient norm"), ("corrupt_chunk", "checksum"),
                 ("garbage_chunk", "undecodable chunk"), ("flipped_byte", "chunk"),
                 ("blosc_bomb", "2147483647 decoded")],
}
SIGNED = {"unsigned", "forged", "not_enrolled"}

# checks whose attacks need a collaboration, a model or the validator: the tests that run them
ELSEWHERE = {
    "loss screen": ["test_claims.py::test_real_local_steps_volunteers_agree_and_a_reversed_one_is_rejected_every_round",
                    "test_hostile_local_steps.py::test_one_reversed_volunteer_in_four_in_the_local_steps_mode_is_"
                    "refused_and_changes_nothing"],
    "checks after close": ["test_aggregators.py::test_shards_admitted_unread_are_checked_by_the_aggregators",
                           "test_aggregators.py::test_control_with_one_aggregator_a_part_false_checks_reject_honest_"
                           "shards"],
    "answers": ["test_aggregators.py::test_an_aggregator_that_lies_changes_no_state_and_is_flagged",
                "test_aggregators.py::test_control_with_one_aggregator_a_part_a_lie_is_committed",
                "test_aggregators.py::test_an_aggregator_whose_checks_lie_is_flagged",
                "test_aggregators.py::test_lamb_an_aggregator_with_false_sums_changes_no_state_and_is_flagged",
                "test_aggregators.py::test_an_aggregator_that_copies_its_partners_answer_is_flagged"],
    "recomputation": ["test_verify.py::test_a_shard_that_does_not_match_its_claim_is_a_mismatch_and_flagged",
                      "test_replay.py::test_the_validator_flags_a_volunteer_whose_inner_steps_trained_on_other_samples"],
    "copy screen": ["test_verify.py::test_a_copy_of_another_volunteers_shard_is_found_without_being_drawn",
                    "test_replay.py::test_a_sparse_copy_is_found_by_the_positions_it_kept"],
    "reference pair": ["test_replay.py::test_sparse_work_on_other_samples_is_held_against_another_volunteers_shard"],
}


def test_every_check_declares_its_attacks():
    """A new check of the catalog fails here until it declares attacks at its moment."""
    declared = set(VALIDATION) | set(ELSEWHERE) | {name for name, *_ in AT_CLOSE}
    assert {c.name for c in catalog.CHECKS} == declared
    assert [c.name for c in catalog.VALIDATION if c.name in VALIDATION] == list(VALIDATION)  # in the catalog's order


@pytest.mark.parametrize("name,tests", sorted(ELSEWHERE.items()))
def test_the_attacks_run_elsewhere_exist(name, tests):
    for node in tests:
        file, _, test = node.partition("::")
        defined = {f.name for f in ast.parse((TESTS / file).read_text()).body if isinstance(f, ast.FunctionDef)}
        assert test in defined, f"{name}: {node} is gone"


# validation: one shard by itself

@pytest.fixture
def signed(tmp_path, bucket):
    """A signed run with mallory enrolled, and a key nobody enrolled."""
    org, mallory, stranger = (identity.generate(tmp_path / f"{n}.pem") for n in ("org", "mallory", "stranger"))
    run = init_run(bucket, small_config("signed", organizer_key=identity.public(org), max_grad_norm=100.0),
                   organizer=org)
    identity.update_roster(bucket, run.name, org, enroll={"honest": identity.public(mallory),
                                                          "bad": identity.public(mallory)})
    return run, mallory, stranger


def _tamper(run, fault: str, signer=None, stranger=None) -> str:
    """Shard ``bad`` of round 0 with ``fault``; its key."""
    grad = None
    if fault == "nan":
        grad = np.zeros(run.flat.n, np.float32)
        grad[123] = np.nan
    if fault == "huge":
        grad = np.full(run.flat.n, 1.0, np.float32)
    forced = {"wrong_codec": {"codec": "fp16"}, "wrong_round": {"round": 3}, "wrong_peer": {"peer": "someone-else"},
              "zero_samples": {"samples": 0}, "made_ahead": {"state_hash": shard.commit_hash({"round": -1})},
              "others_stream": {"data": {"stream": "honest", "ranges": [[10**9, 4]]}},
              "negative_loss": {"loss": -1.0},
              "too_many_samples": {"samples": 10**6, "data": {"stream": "bad", "ranges": [[0, 10**6]]}},
              "far_ahead": {"data": {"stream": "bad", "ranges": [[10**9, 4]]}}}.get(fault, {})
    key = put_shard(run, 0, "bad", grad=grad, manifest=forced)
    mkey = run.keys.manifest(key)
    if fault in SIGNED - {"unsigned"}:
        m = run.bucket.read_json(mkey)
        m["signature"] = identity.sign(stranger, {k: v for k, v in m.items() if k != "signature"})
        if fault == "not_enrolled":
            run.bucket.delete(mkey)
            key = put_shard(run, 0, "stranger", grad=grad)
            mkey = run.keys.manifest(key)
            m = run.bucket.read_json(mkey)
            m["signature"] = identity.sign(stranger, {k: v for k, v in m.items() if k != "signature"})
        run.bucket.write_json(mkey, m)
    if fault == "bad_json":
        run.bucket.write_bytes(mkey, b"{not json")
    if fault == "truncated":
        run.bucket.write_bytes(mkey, run.bucket.read_bytes(mkey)[:40])
    if fault == "corrupt_chunk":
        other = put_shard(run, 0, "other", grad=np.full(run.flat.n, 2e-4, np.float32), part="0002")
        shutil.copy(run.bucket.path(f"{other}/values/c/0"), run.bucket.path(f"{key}/values/c/0"))
        run.bucket.delete(other)
        run.bucket.delete(run.keys.manifest(other))
    if fault == "garbage_chunk":
        run.bucket.write_bytes(f"{key}/values/c/0", np.random.default_rng(0).bytes(5000))
    if fault == "flipped_byte":  # one chunk inside the shard's single object
        stored = bytearray(run.bucket.read_bytes(f"{key}/values/c/0"))
        stored[len(stored) // 3] ^= 0xFF
        run.bucket.write_bytes(f"{key}/values/c/0", bytes(stored))
    if fault == "blosc_bomb":  # a frame whose header claims 2 GiB decoded: refused before Blosc allocates it
        stored = bytearray(run.bucket.read_bytes(f"{key}/values/c/0"))
        stored[4:8] = (2**31 - 1).to_bytes(4, "little")  # the first chunk's frame starts the shard
        run.bucket.write_bytes(f"{key}/values/c/0", bytes(stored))
    if fault == "missing_chunk":  # zarr reads a missing chunk as zeros: the checksum catches it
        run.bucket.delete(f"{key}/values/c/0")
    return key


def _roster(run):
    return identity.read_roster(run.bucket, run.name, run.config.organizer_key) if run.signed else None


@pytest.mark.parametrize("check,fault,reason", [(c, f, r) for c, faults in VALIDATION.items() for f, r in faults])
def test_a_bad_shard_is_rejected_by_its_check_and_the_round_goes_on(make_run, signed, caplog, check, fault, reason):
    """The scheduler rejects the shard with the reason, logged, and commits the round without
    it; judged alone, the catalog names the check that refused it. Control: the honest shard of
    the same round (and the same shard untampered, below) passes every check."""
    if fault in SIGNED:
        run, mallory, stranger = signed
        put_shard(run, 0, "honest", samples=24)
        m = run.bucket.read_json(run.keys.manifest(run.keys.shard(0, "honest", "0001")))
        m["signature"] = identity.sign(mallory, {k: v for k, v in m.items() if k != "signature"})
        run.bucket.write_json(run.keys.manifest(run.keys.shard(0, "honest", "0001")), m)
        key = _tamper(run, fault, mallory, stranger)
    else:
        run = make_run(max_grad_norm=100.0)
        put_shard(run, 0, "honest", samples=24)
        key = _tamper(run, fault)
    with pytest.raises(Rejected) as caught:
        catalog.validate(run, 0, key, run.bucket.read_bytes(run.keys.manifest(key)), _roster(run))
    assert caught.value.check == check and reason in str(caught.value), (caught.value.check, str(caught.value))
    with caplog.at_level(logging.WARNING, logger="dedloc_pipeline.organizer.judge"):
        close = Scheduler(run, 1, 0).try_close(0)
    assert [s.peer for s in close.accepted] == ["honest"]
    assert len(close.rejected) == 1 and reason in close.rejected[0].reason
    assert any("rejected shard" in r.message and key in r.message for r in caplog.records)
    commit = finish(run, 0)  # the round goes on without it
    assert commit["contributors"] == ["honest"] and commit["rejected"] == [x.dump() for x in close.rejected]


def test_control_an_honest_shard_passes_every_validation_check(make_run):
    run = make_run(max_grad_norm=100.0)
    key = put_shard(run, 0, "bad")
    entry = catalog.validate(run, 0, key, run.bucket.read_bytes(run.keys.manifest(key)))
    assert entry.peer == "bad" and entry.samples == 4 and entry.norm > 0


def test_a_rejection_after_the_own_stream_check_spends_the_samples_it_named(make_run):
    """From the own-stream check on the manifest is its peer's own: a rejection carries its
    samples (its stream advances past them); before it, none."""
    run = make_run(max_grad_norm=100.0)
    for fault, spent in (("wrong_codec", False), ("nan", True)):
        key = _tamper(run, fault)
        with pytest.raises(Rejected) as caught:
            catalog.validate(run, 0, key, run.bucket.read_bytes(run.keys.manifest(key)))
        assert (caught.value.data is not None) == spent, fault
        run.bucket.delete(key)
        run.bucket.delete(run.keys.manifest(key))


# close: a shard among the round's others

def _entry(peer: str, part: str = "0001", start: int = 0, norm: float = 1.0, sketch=None) -> Entry:
    e = Entry(key=f"{peer}/{part}", peer=peer, part=part, round=1, samples=8, loss=5.0, stale_samples=0,
              checksums={"values": ["0" * 16]}, data=DataRef(stream=peer, ranges=[(start, 8)]), norm=norm,
              manifest_sha="0" * 64)
    e._sketch = sketch
    return e


_UP, _DOWN = np.ones(16, np.float32), -np.ones(16, np.float32)
_FLAG = Flag(volunteer="m", peer="m", round=0, verdict="mismatch", reason="differs", flagged_at=0.0)
# check, the config it runs with, the flags, the attack's entries, the control's, and what the attack loses
AT_CLOSE = [
    ("parts", {"close": {"max_parts": 2}}, {},
     [_entry("m", "0001"), _entry("m", "0002", start=8), _entry("m", "0003", start=16), _entry("a")],
     [_entry("m", "0001"), _entry("m", "0002", start=8), _entry("a")], ["m/0003"]),
    ("parts", {"close": {"max_parts": 2}}, {},
     [_entry("m", "0001"), _entry("m", "0002", start=4), _entry("a")],  # the same samples twice
     [_entry("m", "0001"), _entry("m", "0002", start=8), _entry("a")], ["m/0002"]),
    ("norm screen", {"norm_screen": 3.0}, {},
     [_entry("a"), _entry("b"), _entry("c"), _entry("m", norm=1e3)],
     [_entry("a"), _entry("b"), _entry("c"), _entry("m", norm=2.5)], ["m/0001"]),
    ("direction screen", {"close": {"min_agreement": 0.0}}, {},
     [_entry("a", sketch=_UP), _entry("b", sketch=_UP), _entry("c", sketch=_UP), _entry("m", sketch=_DOWN)],
     [_entry("a", sketch=_UP), _entry("b", sketch=_UP), _entry("c", sketch=_UP), _entry("m", sketch=_UP)],
     ["m/0001"]),
    ("flags", {}, {"m": _FLAG}, [_entry("a"), _entry("m")], [_entry("a"), _entry("m")], ["m/0001"]),
]


@pytest.mark.parametrize("check,config,flags,attack,control,lost", AT_CLOSE,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(AT_CLOSE)])
def test_a_close_check_rejects_its_attack_and_keeps_its_control(check, config, flags, attack, control, lost):
    """Run alone, the check rejects exactly the attack's shard; through every close check in
    the catalog's order (``catalog.admit``, what the scheduler runs), so is it, and without this
    check no other catches it. Control: the same round without the attack keeps every shard
    (its flags given only to the attack)."""
    cfg = small_config(**config)
    judge = next(c for c in catalog.AT_CLOSE if c.name == check).judge
    kept, out = judge(attack, catalog.Round(cfg, flags))
    assert [x.key for x in out] == lost
    assert sorted(e.key for e in kept) == sorted(e.key for e in attack if e.key not in lost)
    kept, out = catalog.admit(attack, catalog.Round(cfg, flags))
    assert [x.key for x in out] == lost
    others = tuple(c for c in catalog.AT_CLOSE if c.name != check)
    assert catalog.admit(attack, catalog.Round(cfg, flags), others)[1] == []
    kept, out = catalog.admit(control, catalog.Round(cfg, {}))
    assert out == [] and len(kept) == len(control)
