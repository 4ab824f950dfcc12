"""The checks' conformance suite: every check of ``checks/catalog.py`` is run through attacks it
must catch and a control it must let through, at its own moment.

A check gets its tests by declaring its attacks here: ``VALIDATION`` (a shard tampered with, then
judged as the scheduler judges it), ``AT_CLOSE`` (a round's entries) or, for the checks whose
attacks need a whole collaboration or a recomputation, ``COLLABORATIONS`` (the attack-and-control
tests at the end of this module). ``test_every_check_declares_its_attacks`` fails for a check
that has none.
"""

from __future__ import annotations

import ast
import logging
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.verify import diloco_run
from dedloc_pipeline.checks import catalog, exchange, flags, recompute, verify
from dedloc_pipeline.checks.flags import Flag
from dedloc_pipeline.organizer import referee
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import shard, view
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.protocol.shard import DataRef, Entry, Rejected
from dedloc_pipeline.storage import vector
from dedloc_pipeline.testing import LockStep, collaborate, small_config
from dedloc_pipeline.trust import identity

from .test_aggregators import LAMB, _collaborate, _organizers, _run
from .test_protocol import finish, put_shard
from .test_replay import MICRO
from .test_verify import finish as close_and_finish, forged, gradient_of, honest_upload, verdicts

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

# checks whose attacks need a whole collaboration, a model or the validator: their attack-and-control
# tests, below (or, as ``file::test``, a multi-process run in a module of its own)
COLLABORATIONS = {
    "loss screen": ["test_real_local_steps_volunteers_agree_and_a_reversed_one_is_rejected_every_round",
                    "test_hostile_local_steps.py::test_one_reversed_volunteer_in_four_in_the_local_steps_mode_is_"
                    "refused_and_changes_nothing"],
    "checks after close": ["test_shards_admitted_unread_are_checked_by_the_aggregators"],
    "answers": ["test_an_aggregator_whose_checks_lie_is_flagged",
                "test_a_pair_that_places_another_parts_object_in_its_answer_copies_nothing_of_it",
                "test_a_pair_that_agrees_every_shard_is_corrupt_decides_nothing",
                "test_an_aggregator_that_lies_changes_no_state_and_is_flagged",
                "test_lamb_an_aggregator_with_false_sums_changes_no_state_and_is_flagged",
                "test_an_aggregator_that_copies_its_partners_answer_is_flagged"],
    "audit": ["test_two_names_of_one_person_agreeing_on_a_lie_are_caught_by_the_audit",
              "test_a_sampled_audit_finds_a_lie_where_its_draw_falls",
              "test_the_draw_leaves_a_lie_the_chance_the_docs_state"],
    "recomputation": ["test_a_shard_that_does_not_match_its_claim_is_a_mismatch_and_flagged",
                      "test_the_validator_flags_a_volunteer_whose_inner_steps_trained_on_other_samples"],
    "copy screen": ["test_a_copy_of_another_volunteers_shard_is_found_without_being_drawn",
                    "test_a_sparse_copy_is_found_by_the_positions_it_kept"],
    "reference pair": ["test_sparse_work_on_other_samples_is_held_against_another_volunteers_shard"],
}


def test_every_check_declares_its_attacks():
    """A new check of the catalog fails here until it declares attacks at its moment."""
    declared = set(VALIDATION) | set(COLLABORATIONS) | {name for name, *_ in AT_CLOSE}
    assert {c.name for c in catalog.CHECKS} == declared
    assert [c.name for c in catalog.VALIDATION if c.name in VALIDATION] == list(VALIDATION)  # in the catalog's order


@pytest.mark.parametrize("name,tests", sorted(COLLABORATIONS.items()))
def test_the_collaborations_attacks_exist(name, tests):
    for node in tests:
        file, _, test = node.rpartition("::")
        defined = {f.name for f in ast.parse((TESTS / (file or "test_checks.py")).read_text()).body
                   if isinstance(f, ast.FunctionDef)}
        assert test in defined, f"{name}: {node} is gone"


# validation: one shard by itself

def _signed(tmp_path, bucket, name: str, enrolled: dict[str, str], others: tuple[str, ...] = (), **cfg):
    """A signed run ``name`` with ``enrolled`` (volunteer -> whose key) in its roster; the
    organizer's key and the others' by name."""
    keys = {n: identity.generate(tmp_path / f"{n}.pem") for n in ("org", *sorted(set(enrolled.values())), *others)}
    run = init_run(bucket, small_config(name, organizer_key=identity.public(keys["org"]), **cfg), organizer=keys["org"])
    if enrolled:
        identity.update_roster(bucket, run.name, keys["org"],
                               enroll={v: identity.public(keys[k]) for v, k in enrolled.items()})
    return run, keys


@pytest.fixture
def signed(tmp_path, bucket):
    """A signed run with honest and mallory (as ``bad``) enrolled, and a key nobody enrolled."""
    run, keys = _signed(tmp_path, bucket, "signed", {"honest": "honest", "bad": "mallory"}, ("stranger",),
                        max_grad_norm=100.0)
    return run, keys["honest"], keys["mallory"], keys["stranger"]


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
    it; judged alone, the catalog names the check that refused it. Values out of any bound
    (non-finite, a norm above ``max_grad_norm``) flag their volunteer too: it cannot try again
    for free; no other rejection flags anyone. Control: the honest shard of the same round (and
    the same shard untampered, below) passes every check."""
    if fault in SIGNED:
        run, honest, mallory, stranger = signed
        put_shard(run, 0, "honest", samples=24)
        m = run.bucket.read_json(run.keys.manifest(run.keys.shard(0, "honest", "0001")))
        m["signature"] = identity.sign(honest, {k: v for k, v in m.items() if k != "signature"})
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
    found = flags.read(run)
    if fault in ("nan", "huge"):
        assert list(found) == ["bad"] and found["bad"].verdict == flags.OUT_OF_BOUNDS and key in found["bad"].reason
    else:
        assert found == {}


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


# the checks after CLOSE and after COMMIT, and the local-steps screens: whole collaborations

def _false_sums(role):
    honest = role.part_sums
    role.part_sums = lambda r, k: [{name: [a * 1.01, b] for name, (a, b) in chunk.items()} for chunk in honest(r, k)]


def _shards(run, r: int, peer: str) -> set[str]:
    return {e.key for e in Close.read(run, r).accepted if e.peer == peer}


def _noise(role):
    honest = role.compute

    def noisy(r, k):
        vectors = honest(r, k)
        p = vectors["params"]["values"]
        p += np.random.default_rng(r).normal(0, 1e-3, p.size).astype(np.float32)
        return vectors
    role.compute = noisy


def _old(role):
    """Its answer for the part from the round before (its first round's: the state it started from)."""
    honest, seen = role.compute, {}

    def old(r, k):
        seen.setdefault(k, []).append(honest(r, k))
        return seen[k][0] if r > 0 else {n: {a: np.zeros_like(x) for a, x in v.items()} for n, v in seen[k][0].items()}
    role.compute = old


SCREENS = {"direction": ({"probe_samples": None}, "points away"),
           "loss": ({"min_agreement": None}, "does not descend the loss of the samples it claims")}


VERIFY_ATTACKS = {
    # name: (the gradient uploaded, the samples and ranges its manifest claims); control: honest
    "inflated": (lambda run: gradient_of(run, "mallory", 0, 8), 64, [(0, 64)]),
    "wrong_data": (lambda run: gradient_of(run, "mallory", 100, 8), 8, [(0, 8)]),
    "scaled": (lambda run: 2.0 * gradient_of(run, "mallory", 0, 8), 8, [(0, 8)]),
    "noise": (lambda run: np.random.default_rng(0).normal(0, 1e-3, run.flat.n).astype(np.float32), 8, [(0, 8)]),
    "honest": (lambda run: gradient_of(run, "mallory", 0, 8), 8, [(0, 8)]),
}


# loss screen

@pytest.mark.parametrize("screen", SCREENS)
def test_real_local_steps_volunteers_agree_and_a_reversed_one_is_rejected_every_round(make_run, screen):
    """Four volunteers of the ``micro`` model taking real inner AdamW steps (in one process, lock
    step): the honest three are never rejected, and mallory, sending its pseudo-gradient reversed
    at 8x (inside the norm screen), is rejected in every round it sends, by each screen alone: the
    direction screen (her sketch against the median volunteer's) and the loss screen (her shard
    points up the loss of the samples she claims, at state r). Control: with both
    screens off, the same collaboration counts mallory's shards."""
    peers = [("a", 4), ("b", 3), ("c", 5), ("mallory", 4)]
    only, reason = SCREENS[screen]
    for rule in (only, {"probe_samples": None, "min_agreement": None}):
        run = make_run(run=f"screen-{len(rule)}", algorithm="diloco", codec="int8", inner_batch=8,
                       target_batch_size=96, optimizer={"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
                       max_grad_norm=1e12, close=rule)
        collaborate(run, peers, 3, tamper={"mallory": lambda g: -8 * g})
        closes = [run.bucket.read_json(run.keys.close(r)) for r in range(3)]
        counted = {s["peer"] for c in closes for s in c["accepted"]}
        if rule is not only:
            assert "mallory" in counted  # the control
            continue
        assert counted == {"a", "b", "c"}
        for close in closes:
            turned = [x for x in close["rejected"] if reason in x["reason"]]
            assert turned and all("/mallory/" in x["key"] for x in close["rejected"]), close["rejected"]

# checks after close

@pytest.mark.parametrize("checks", ["on", "control: off"])
@pytest.mark.parametrize("fault", ["scaled", "corrupt"])
def test_shards_admitted_unread_are_checked_by_the_aggregators(tmp_path, bucket, monkeypatch, fault, checks):
    """The scheduler admits shards on their manifests and copies them unread; x and y check
    each part of every one as they read it for the reduction, and the scheduler rejects what
    their agreed checks refuse: b's gradient scaled past ``max_grad_norm``, or b's frozen copy
    with one bit flipped (its manifest's checksums no longer match). Every state
    is the organizer's answer without b's shards, all parts the aggregators'. Control, the
    checks' verdicts ignored: b's scaled shards count; its corrupt copy stops the round (the
    reduction refuses it: no state at all)."""
    run, keys = _run(tmp_path, bucket)
    if fault == "scaled":
        tamper = {"b": lambda g: g * 1e9}
    else:
        from dedloc_pipeline.checks import validation
        tamper, freeze = {}, validation.freeze

        def corrupt(run_, key):
            frozen = freeze(run_, key)
            if run_.keys.shard_parts(key)[1] == "b":
                key = f"{frozen}/{sorted(vector.chunk_objects(run_.grad_format))[0]}"
                data = run_.bucket.read_bytes(key)
                run_.bucket.write_bytes(key, data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
            return frozen
        monkeypatch.setattr(validation, "freeze", corrupt)
    if checks != "on":
        monkeypatch.setattr(referee.admission, "judge_contents",
                            lambda accepted, verdicts, max_norm, factor: (accepted, []))
    with LockStep(run, volunteers=True) as c:
        for n, mb in (("a", 4), ("b", 3)):
            c.join(n, mb, signer=keys[n], tamper=tamper.get(n))
        for n in ("x", "y"):
            c.aggregate(n, keys[n])
        if checks != "on" and fault == "corrupt":  # the organizer's reduction refuses it: no state at all
            with pytest.raises(vector.CorruptShard):
                c.until(lambda: run.latest() > 0, 400, "state 1")
            return
        c.until(lambda: run.latest() > 0, 400, "state 1")
    close, commit = Close.read(run, 0), run.commit_of(1)
    assert close.accepted and all(e.norm is None for e in close.accepted)  # admitted unread
    screened = run.read_record(run.keys.screened(0), "checks", round=0)
    assert screened["parts"] == list(range(run.n_parts))  # every part checked by both aggregators
    if checks != "on":  # b's scaled gradient counts
        assert "b" in commit["contributors"]
        return
    assert {x["key"] for x in screened["rejected"]} == _shards(run, 0, "b")
    why = "above the bound" if fault == "scaled" else "not its manifest's"
    assert all(why in x["reason"] for x in commit["rejected"] if x["key"] in _shards(run, 0, "b"))
    assert commit["contributors"] == ["a"] and commit["checksums"] == _organizers(run, 0)
    assert all(sorted(by) == ["x", "y"] for by in commit["aggregated_by"])
    # a norm out of bounds is b's own doing: flagged; a frozen copy that no longer matches its
    # checksums may be the store's: nobody is
    assert {n: f.verdict for n, f in flags.read(run).items()} == ({"b": flags.OUT_OF_BOUNDS} if fault == "scaled"
                                                                    else {})

# answers

def test_an_aggregator_whose_checks_lie_is_flagged(tmp_path, bucket, monkeypatch):
    """x reports every shard corrupt in its parts: y disagrees, the organizer checks those parts
    itself, rejects nothing and flags x (only x); every state is the organizer's answer with
    every shard."""
    run, keys = _run(tmp_path, bucket)

    def liar(roles):
        x = roles["x"]
        honest = x.check
        x.check = lambda close, k: [[-1.0] * len(c) for c in honest(close, k)]
    states, _, _ = _collaborate(run, keys, tamper=liar)
    assert run.read_record(run.keys.screened(0), "checks", round=0)["rejected"] == []
    assert states[0]["contributors"] == ["a", "b"]
    assert list(flags.read(run)) == ["x"] and "checks" in flags.read(run)["x"].reason


@pytest.mark.parametrize("rejudged", [True, False], ids=["judged again", "control: not judged again"])
def test_a_pair_that_agrees_every_shard_is_corrupt_decides_nothing(tmp_path, bucket, monkeypatch, rejudged):
    """x and y, one person's two names in effect, both report every shard corrupt in every part:
    they agree, but a shard rejected by a part's aggregators is checked again in that part by the
    organizer before the round counts without it. It is sound: nothing is rejected, the round's
    step takes every shard, both are flagged. Control: not judged again, the pair rejects every
    shard and the round commits a step on no gradient."""
    if not rejudged:
        monkeypatch.setattr(referee.Referee, "_rejudge", lambda self, close, checks, out: checks)
    run, keys = _run(tmp_path, bucket)

    def liars(roles):
        for role in roles.values():
            honest = role.check
            role.check = lambda close, k, honest=honest: [[-1.0] * len(c) for c in honest(close, k)]
    states, _, _ = _collaborate(run, keys, tamper=liars)
    rejected = run.read_record(run.keys.screened(0), "checks", round=0)["rejected"]
    if rejudged:
        assert rejected == [] and states[0]["contributors"] == ["a", "b"]
        assert sorted(flags.read(run)) == ["x", "y"] and "organizer found sound" in flags.read(run)["x"].reason
    else:
        assert len(rejected) == len(Close.read(run, 0).accepted) and states[0]["samples"] == 0
        assert flags.read(run) == {}


@pytest.mark.parametrize("attack", ["noise", "old part", "noise, lamb"])
def test_an_aggregator_that_lies_changes_no_state_and_is_flagged(tmp_path, bucket, attack):
    """x adds noise to its parameters (with LAMB too, its sums honest), or answers with an old
    part: y disagrees, the organizer computes each part itself, and x, only x, is flagged; from
    then on its offers are refused and z would take its place. Every state is the organizer's answer."""
    run, keys = _run(tmp_path, bucket, **(LAMB if "lamb" in attack else {}))
    states, _, _ = _collaborate(run, keys, tamper=lambda roles: (_old if attack == "old part" else _noise)(roles["x"]))
    assert states[0]["aggregated_by"] == [["organizer"]] * run.n_parts
    assert list(flags.read(run)) == ["x"]
    assert "differs from the organizer's" in flags.read(run)["x"].reason
    assert Close.read(run, 1).aggregators is None  # y alone offers now: the organizer's


def test_lamb_an_aggregator_with_false_sums_changes_no_state_and_is_flagged(tmp_path, bucket):
    """x reveals every parameter norm 1% high: no part's sums agree, the organizer sums every
    part itself, x, only x, is flagged; every state is the organizer's answer."""
    run, keys = _run(tmp_path, bucket, **LAMB)
    states, _, _ = _collaborate(run, keys, tamper=lambda roles: _false_sums(roles["x"]))
    assert run.read_record(run.keys.norms(0), "norms", round=0)["parts"] == []
    assert states[0]["aggregated_by"] == [["organizer"]] * run.n_parts
    assert list(flags.read(run)) == ["x"]
    assert "partial sums" in flags.read(run)["x"].reason


def _other_bytes(role):
    """Its answer's checksums honest, its objects' bytes other (its parameters moved after its claim)."""
    reveal = role._reveal

    def tampered(w, k):
        if w.stage is exchange.PARTS:
            w.answers[k]["params"]["values"] += np.float32(1e-3)
        return reveal(w, k)
    role._reveal = tampered


def _wave_through(role):
    """Its checks of b's shards divided by 10^18: b's gradient, scaled 10^9, passes the bound."""
    honest = role.check
    role.check = lambda close, k: [[v / 1e18 for v in c] if e.peer == "b" else c
                                   for e, c in zip(close.accepted, honest(close, k))]


def _is_damaged(run, commit) -> bool:
    """Whether state 1 is not what the organizer's own answer for round 0 is, or fails its COMMIT."""
    from dedloc_pipeline.organizer import repair
    return commit["checksums"] != _organizers(run, 0) or not repair.diagnose(run).healthy


COLLUSIONS = {
    # name: (run settings, what b's gradient is, what x and y both do, the audit that finds it, the damage)
    "noise over every part": ({}, None, _noise, "answer", _is_damaged),
    "false LAMB sums": (LAMB, None, _false_sums, "sums", _is_damaged),
    "objects other than their checksums": ({}, None, _other_bytes, "answer", _is_damaged),
    "a scaled shard waved through": ({}, lambda g: g * 1e9, _wave_through, "screen",
                                     lambda run, commit: "b" in commit["contributors"]),
}


@pytest.mark.parametrize("audited", [True, False], ids=["audited", "control: no audit"])
@pytest.mark.parametrize("attack", COLLUSIONS)
def test_two_names_of_one_person_agreeing_on_a_lie_are_caught_by_the_audit(tmp_path, bucket, monkeypatch,
                                                                            attack, audited):
    """x and y, two names of one person, tell the same lie in every part they share (all of
    them): they agree, and the organizer's audit of each agreement (whole here: neither has
    earned trust yet) recomputes what they claimed. The lie is found before COMMIT: the state is
    the organizer's own answer and passes its COMMIT's checks, both are flagged, and the round's
    audit record says what was found. Control: without the audit the lie is committed."""
    from dedloc_pipeline.checks import audit
    from dedloc_pipeline.organizer import repair
    settings, gradient, lie, stage, damaged = COLLUSIONS[attack]
    if not audited:
        monkeypatch.setattr(audit, stage, lambda *a, **kw: None)
    run, keys = _run(tmp_path, bucket, **settings)
    with LockStep(run, volunteers=True) as c:
        c.join("a", 4, signer=keys["a"])
        c.join("b", 3, signer=keys["b"], tamper=gradient)
        for n in ("x", "y"):
            lie(c.aggregate(n, keys[n]))
        c.until(lambda: run.latest() > 0, 400, "state 1")
    commit = run.commit_of(1)
    found = run.read_record(run.keys.audits(0), "audits", round=0)
    if not audited:
        assert damaged(run, commit) and flags.read(run) == {}
        assert not any(a["found"] for a in found["audits"])
        return
    assert not damaged(run, commit) and repair.diagnose(run).healthy
    found_flags = {n: f.verdict for n, f in flags.read(run).items()}  # b's scaled shards are its own: flagged
    scaled = {"b": flags.OUT_OF_BOUNDS} if gradient else {}
    assert found_flags == {"x": flags.WRONG_PART, "y": flags.WRONG_PART, **scaled}
    assert "audit" in flags.read(run)["x"].reason
    caught = [a for a in found["audits"] if a["found"]]
    assert caught and {a["stage"] for a in caught} == {{"answer": "parts"}.get(stage, stage)}
    assert audit.check_secret(run, Close.read(run, 0), found["secret"])  # anyone can check the draw


def test_the_draw_leaves_a_lie_the_chance_the_docs_state():
    """A lie over c of a part's n chunks survives an audit of a drawn chunks with probability
    C(n-c, a)/C(n, a) (``draw.survival``, the number docs/aggregators.md states): measured over
    4,000 secrets, within four standard errors; a lie over the whole part never survives."""
    from dedloc_pipeline.checks import draw
    n, lied, trials = 8, {0, 1}, 4000
    for fraction in (1 / 8, 1 / 4, 1 / 2):
        a = math.ceil(fraction * n)
        survived = sum(not lied & set(draw.draw(str(i), 0, range(n), fraction)) for i in range(trials)) / trials
        p = draw.survival(n, a, len(lied))
        assert abs(survived - p) < 4 * math.sqrt(p * (1 - p) / trials), (fraction, survived, p)
        assert draw.survival(n, a, n) == 0.0
        assert all(set(draw.draw(str(i), 0, range(n), fraction)) & set(range(n)) for i in range(100))


@pytest.mark.parametrize("where", ["whole part", "one chunk"])
def test_a_sampled_audit_finds_a_lie_where_its_draw_falls(tmp_path, bucket, monkeypatch, where):
    """Aggregators that have earned trust (``TRUSTED_AFTER`` 0 here) are audited on a third of
    each part's three chunks. x and y lie together in every part: over the whole part, every
    audit finds it; in the part's first chunk only, exactly the audits whose draw holds that
    chunk do, before a lie is caught, and every part after (audited whole once one was)."""
    monkeypatch.setattr(referee, "TRUSTED_AFTER", 0)
    run, keys = _run(tmp_path, bucket, chunks_per_part=3, close={"audit": 1 / 3})
    size = run.dense_format.chunk_size

    def lie(role):
        honest = role.compute

        def noisy(r, k):
            vectors = honest(r, k)
            p = vectors["params"]["values"]
            span = slice(None) if where == "whole part" else slice(0, size)
            p[span] += np.random.default_rng(r).normal(0, 1e-3, p[span].size).astype(np.float32)
            return vectors
        role.compute = noisy
    with LockStep(run, volunteers=True) as c:
        c.join("a", 4, signer=keys["a"])
        c.join("b", 3, signer=keys["b"])
        for n in ("x", "y"):
            lie(c.aggregate(n, keys[n]))
        c.until(lambda: run.latest() > 0, 400, "state 1")
    found = [a for a in run.read_record(run.keys.audits(0), "audits", round=0)["audits"] if a["stage"] == "parts"]
    assert len(found) == run.n_parts and run.n_parts >= 2
    whole = False
    for a in found:
        chunks = run.part_chunks(a["part"])
        assert len(a["chunks"]) == (len(chunks) if whole else 1)
        assert bool(a["found"]) == (where == "whole part" or chunks[0] in a["chunks"]), a
        whole = whole or bool(a["found"])
    if where == "whole part":
        assert run.commit_of(1)["checksums"] == _organizers(run, 0) and sorted(flags.read(run)) == ["x", "y"]


@pytest.mark.parametrize("stray", [True, False], ids=["misplaced object", "control: its part's own objects"])
def test_a_pair_that_places_another_parts_object_in_its_answer_copies_nothing_of_it(tmp_path, bucket, stray):
    """x and y, one person's two names in effect, agree on every answer, and under their answer
    for the last part both place a copy of one of its chunk objects at a chunk of part 0 (settled
    before it). Only the keys of the part an aggregator was given are ever copied: the last part
    is the organizer's, both are flagged, and every committed state passes its own COMMIT's
    checks (``dedloc repair`` finds it healthy; copied, the stray object overwrote part 0's chunk).
    Control: the same pair without the stray object settles every part, nobody flagged."""
    from dedloc_pipeline.organizer import repair
    run, keys = _run(tmp_path, bucket)
    last, other = run.n_parts - 1, run.part_chunks(0)[0]

    def misplace(roles):
        for role in roles.values():
            write = role._write

            def _write(key, record, role=role, write=write):
                r = record.get("round")
                if stray and key == run.keys.result(r, role.peer, last):  # its objects are in: add the stray one
                    base = run.keys.answer(r, role.peer, last)
                    found = sorted(run.keys.state_path(base, k) for k in run.bucket.listing(base))
                    path, chunk = next(x for x in found if x is not None)
                    dest = path.removesuffix(f"/c/{chunk}") + f"/c/{other}"
                    run.bucket.copy(run.keys.answer_object(r, role.peer, last, path),
                                    run.keys.answer_object(r, role.peer, last, dest))
                return write(key, record)
            role._write = _write
    states, _, _ = _collaborate(run, keys, tamper=misplace)
    assert repair.diagnose(run).healthy
    if stray:
        assert states[0]["aggregated_by"][last] == ["organizer"] and sorted(flags.read(run)) == ["x", "y"]
        assert "objects of other parts" in flags.read(run)["x"].reason
    else:
        assert all(sorted(by) == ["x", "y"] for by in states[0]["aggregated_by"]) and flags.read(run) == {}


def test_an_aggregator_that_copies_its_partners_answer_is_flagged(tmp_path, bucket):
    """x computes nothing: it claims a made-up digest, and once y reveals, copies y's objects and
    result as its own. Its result is not its claim: flagged, the part the organizer's."""
    run, keys = _run(tmp_path, bucket)

    def copier(roles):
        x, y = roles["x"], roles["y"]
        x.compute = lambda r, k: {n: {a: np.zeros_like(v) for a, v in arrays.items()}
                                  for n, arrays in y.compute(r, k).items()}
        claim = x.step

        def step():
            v = view.read(run.bucket, run.keys, run.config.organizer_key)
            if v is None or v.reveal != "parts":
                return claim()
            for (r, k), done in x.done.items():
                theirs = run.bucket.read_json(run.keys.result(r, "y", k))
                if theirs is not None:
                    listed = run.bucket.listing(run.keys.answer(r, "y", k))
                    for key in listed:
                        run.bucket.copy(key, key.replace("/volunteers/y/", "/volunteers/x/"))
                    x._write(run.keys.result(r, "x", k), {"round": r, "peer": "x", "part": k,
                                                           "checksums": theirs["checksums"]})
        x.step = step
    states, _, _ = _collaborate(run, keys, tamper=copier)
    assert states[0]["aggregated_by"] == [["organizer"]] * run.n_parts
    assert list(flags.read(run)) == ["x"] and "other than it claimed" in flags.read(run)["x"].reason

# recomputation

@pytest.mark.parametrize("attack", sorted(VERIFY_ATTACKS))
@pytest.mark.slow
def test_a_shard_that_does_not_match_its_claim_is_a_mismatch_and_flagged(make_run, attack):
    run = make_run(codec="int8", target_batch_size=24, keep_states=10)
    make, samples, ranges = VERIFY_ATTACKS[attack]
    forged(run, "mallory", make(run), samples, ranges)
    honest_upload(run, "alice")
    honest_upload(run, "bob")  # three volunteers: each counts a third of the round
    close_and_finish(run, 0)
    record = verify.Verifier(run, fraction=1.0, device="cpu").verify_round(0)
    got = verdicts(record)
    assert got["alice"]["verdict"] == got["bob"]["verdict"] == "ok"
    found = flags.read(run)
    if attack == "honest":
        assert got["mallory"]["verdict"] == "ok" and found == {}
        return
    assert got["mallory"]["verdict"] == "mismatch" and got["mallory"]["flag"], got["mallory"]
    assert list(found) == ["mallory"] and found["mallory"].round == 0
    assert found["mallory"].shard == got["mallory"]["key"] and "differs" in found["mallory"].reason
    if attack == "scaled":
        assert got["mallory"]["cosine"] > 0.99 and got["mallory"]["norm_ratio"] == pytest.approx(2, rel=0.01)


@pytest.mark.parametrize("attack", ["poisoned", "honest"])
def test_the_validator_flags_a_volunteer_whose_inner_steps_trained_on_other_samples(bucket, attack):
    """Poisoned work looks honest to every screen before CLOSE (its pseudo-gradient is a real
    one, of other samples of mallory's stream), so its shards are accepted; the validator
    replays every accepted shard and flags mallory, and only mallory. Control: mallory honest,
    nobody flagged."""
    run, _, _ = diloco_run("int8", "fp32", attack, rounds=2, size=MICRO, bucket=bucket)
    assert any(e.peer == "mallory" for r in range(2) for e in Close.read(run, r).accepted)
    assert verify.Verifier(run, fraction=1.0, device="cpu").serve(until_round=1) == 2
    shards = [s for r in range(2) for s in run.bucket.read_json(run.keys.verdicts(r))["shards"]]
    assert all(s["verdict"] == "ok" for s in shards if s["peer"] != "mallory")
    assert any(s["stale_samples"] for s in shards)
    mine = [s for s in shards if s["peer"] == "mallory"]
    if attack == "honest":
        assert all(s["verdict"] == "ok" for s in mine) and flags.read(run) == {}
        return
    assert all(s["verdict"] == "mismatch" and s["flag"] for s in mine), mine
    assert "pseudo-gradient replayed on its data differs" in mine[0]["reason"]
    assert list(flags.read(run)) == ["mallory"]

# copy screen

@pytest.mark.parametrize("copied", [True, False])
def test_a_copy_of_another_volunteers_shard_is_found_without_being_drawn(make_run, copied):
    """mallory uploads alice's very codes as its own (claiming its own stream): the pairwise
    screen finds the pair with nothing drawn (fraction 0), recomputes both, and flags the one
    whose data does not give its gradient, whichever was uploaded first. Control: mallory's own
    honest shard, no pair."""
    run = make_run(codec="int8", target_batch_size=48, keep_states=10)
    alice = honest_upload(run, "alice")
    entry = catalog.validate(run, 0, alice, run.bucket.read_bytes(run.keys.manifest(alice)))
    if copied:
        arrays = vector.read_vector(run.bucket, alice, run.grad_format, checksums=entry.checksums, raw=True)
        forged(run, "mallory", None, entry.samples, [(0, entry.samples)], arrays=arrays)
    else:
        honest_upload(run, "mallory")
    close_and_finish(run, 0)
    record = verify.Verifier(run, fraction=0.0, at_least=0, device="cpu").verify_round(0)
    got = verdicts(record)
    if not copied:
        assert got == {} and record["copy_screen"]["pairs"] == []
        assert record["copy_screen"]["max_cosine"] < recompute.COPY_COSINE
        return
    assert record["copy_screen"]["pairs"][0]["cosine"] > 0.9999
    assert got["alice"]["verdict"] == "ok" and got["alice"]["why"] == "copy screen"
    assert got["mallory"]["verdict"] == "copy" and got["mallory"]["copy_of"] == alice
    assert list(flags.read(run)) == ["mallory"]


@pytest.mark.parametrize("attack,without", [("disguised", None), ("disguised", "overlap"), ("copied", None),
                                            ("copied", "pair bound"), ("honest", None)])
def test_a_sparse_copy_is_found_by_the_positions_it_kept(bucket, attack, without):
    """mallory uploads volunteer a's sparse shard as its own: copied whole, or disguised (each
    block scaled by its own random factor: other values, the same positions). Nothing is drawn
    (fraction 0): the copy screen pairs the disguised copy with a by the overlap of their kept
    positions (1.0; honest pairs under 0.1), the whole copy by its cosine, and calls mallory's
    the copy, its kept entries' cosine with its replay (about 0.7) short of a's (0.999), though
    above the sparse tolerance (0.5). Controls: without the overlap screen the disguised
    copy (cosine about 0.87) is never paired; without the pair's bound the whole copy is paired
    and passes; mallory honest, nobody is paired."""
    run, _, _ = diloco_run("sparse", "fp32", attack, rounds=2, size=MICRO, bucket=bucket)
    tol = recompute.tolerance(run.config)
    verifier = verify.Verifier(run, fraction=0.0, at_least=0, device="cpu",
                               copy_overlap=None if without == "overlap" else recompute.COPY_OVERLAP,
                               tolerance=replace(tol, pair_cosine=None) if without == "pair bound" else None)
    assert verifier.serve(until_round=1) == 2
    records = [run.bucket.read_json(run.keys.verdicts(r)) for r in range(2)]
    screens = [rec["copy_screen"] for rec in records]
    shards = [s for rec in records for s in rec["shards"]]
    mine = [s for s in shards if s["peer"] == "mallory"]
    assert all(s["max_cosine"] < 0.95 for s in screens) == (attack != "copied")
    assert all((s["max_overlap"] == 1.0) == (attack != "honest") for s in screens), screens
    if attack == "honest" or without == "overlap":
        assert shards == [] and all(s["pairs"] == [] for s in screens) and flags.read(run) == {}
        assert attack != "honest" or all(s["max_overlap"] < 0.2 for s in screens)
        return
    assert all(len(s["pairs"]) == 1 for s in screens), screens
    assert len(mine) == 2 and all(tol.min_cosine < s["cosine"] < tol.pair_cosine for s in mine), mine
    assert all(s["verdict"] == "ok" and s["peer"] == "a" for s in shards if s["peer"] != "mallory")
    if without == "pair bound":
        assert all(s["verdict"] == "ok" for s in mine) and flags.read(run) == {}
        return
    assert all(s["verdict"] == "copy" for s in mine) and list(flags.read(run)) == ["mallory"]
    a = next(s["key"] for s in shards if s["peer"] == "a")
    assert "kept positions overlap 1.000" in mine[0]["reason"] and f"as far from 1 as that of {a}" in mine[0]["reason"]

# reference pair

@pytest.mark.parametrize("attack,drawn", [("poisoned", "all"), ("poisoned", "mallory"), ("poisoned", "no pair bound"),
                                          ("honest", "mallory")])
def test_sparse_work_on_other_samples_is_held_against_another_volunteers_shard(bucket, monkeypatch, attack, drawn):
    """mallory's inner steps train on other samples than it claims (poisoned). Its sparse
    shards pass the sparse tolerance (kept entries' cosine about 0.7, bound 0.5) but are short of
    the honest volunteers' replays of the same rounds (0.999: ``Tolerance.short_of``), so they
    are mismatches, with every shard drawn or with mallory's alone (then one honest shard a
    round is replayed as its reference). Controls: without the pair bound mallory passes;
    mallory honest and drawn alone, no reference is replayed."""
    run, _, _ = diloco_run("sparse", "fp32", attack, rounds=2, size=MICRO, bucket=bucket)
    if drawn == "mallory":
        monkeypatch.setattr(verify, "chosen", lambda accepted, *_: [e for e in accepted if e.peer == "mallory"])
    tol = recompute.tolerance(run.config)
    verifier = verify.Verifier(run, fraction=1.0, device="cpu",
                               tolerance=replace(tol, pair_cosine=None) if drawn == "no pair bound" else None)
    assert verifier.serve(until_round=1) == 2
    shards = [s for r in range(2) for s in run.bucket.read_json(run.keys.verdicts(r))["shards"]]
    mine = [s for s in shards if s["peer"] == "mallory"]
    assert len(mine) == 2 and all(s["verdict"] == "ok" for s in shards if s["peer"] != "mallory"), shards
    references = [s for s in shards if s["why"] == "reference"]
    assert len(references) == (2 if (attack, drawn) == ("poisoned", "mallory") else 0), references
    if attack == "honest" or drawn == "no pair bound":
        assert all(s["verdict"] == "ok" for s in mine) and flags.read(run) == {}
        assert attack == "honest" or all(tol.min_cosine < s["cosine"] < tol.pair_cosine for s in mine)
        return
    assert all(s["verdict"] == "mismatch" and s["flag"] and s["cosine"] < tol.pair_cosine for s in mine), mine
    assert "of another volunteer" in mine[0]["reason"] and list(flags.read(run)) == ["mallory"]


# one key, one volunteer: a name is not a person

def test_the_roster_refuses_a_key_under_a_second_name(tmp_path, bucket):
    """One person cannot hold two names: a key enrolled as one volunteer is refused under
    another (at once or later), and a revoked one under any. Control: the same names with keys
    of their own enrol, and enrolling a name again with its own key changes nothing."""
    run, keys = _signed(tmp_path, bucket, "keys", {}, ("k1", "k2"))
    org, k1, k2 = keys["org"], keys["k1"], keys["k2"]
    with pytest.raises(identity.IdentityError, match="one key is one volunteer"):
        identity.update_roster(bucket, run.name, org, enroll={"m1": identity.public(k1), "m2": identity.public(k1)})
    identity.update_roster(bucket, run.name, org, enroll={"m1": identity.public(k1)})
    with pytest.raises(identity.IdentityError, match="enrolled as 'm1'"):
        identity.update_roster(bucket, run.name, org, enroll={"m2": identity.public(k1)})
    identity.update_roster(bucket, run.name, org, revoke=["m1"])
    with pytest.raises(identity.IdentityError, match="revoked"):
        identity.update_roster(bucket, run.name, org, enroll={"m3": identity.public(k1)})
    roster = identity.update_roster(bucket, run.name, org, enroll={"m2": identity.public(k2)})
    assert roster.volunteers == {"m1": identity.public(k1), "m2": identity.public(k2)}
    assert identity.update_roster(bucket, run.name, org, enroll={"m2": identity.public(k2)}).volunteers == \
        roster.volunteers


def test_a_flagged_key_stays_out_under_any_name(tmp_path, bucket):
    """mallory is flagged; the organizer gives the name to a new key and enrols her old key as
    ``eve``: eve's shards and offers are refused, the flag binds the key. ``dedloc enroll``
    refuses that key under any name. Control: a volunteer with a key of its own counts."""
    from typer.testing import CliRunner

    from dedloc_pipeline.checks import flags as flag_records
    from dedloc_pipeline.cli import app
    run, keys = _signed(tmp_path, bucket, "flagged", {"mallory": "mallory", "honest": "honest"}, ("fresh",),
                        target_batch_size=8)
    org, mallory, fresh = keys["org"], keys["mallory"], keys["fresh"]
    flag_records.raise_flag(run, Flag(volunteer="mallory", peer="mallory", round=0, verdict="mismatch",
                                      reason="differs", flagged_at=0.0))
    assert flag_records.read(run)["mallory"].key == identity.public(mallory)
    res = CliRunner().invoke(app, ["enroll", "--bucket", bucket.url, "--run", run.name, "--organizer-key",
                                   str(tmp_path / "org.pem"), "--volunteer", "eve",
                                   "--public-key", identity.public(mallory)])
    assert res.exit_code == 2 and "refused (mallory was flagged in round 0)" in res.output, res.output
    identity.update_roster(bucket, run.name, org, enroll={"mallory": identity.public(fresh)}, replace=True)
    identity.update_roster(bucket, run.name, org, enroll={"eve": identity.public(mallory)})  # past the CLI
    roster = _roster(run)
    eve, good = _entry("eve"), _entry("honest")
    kept, out = catalog.admit([eve, good], catalog.Round(run.config, flag_records.read(run), roster))
    assert [e.key for e in kept] == ["honest/0001"] and [x.key for x in out] == ["eve/0001"]
    assert "volunteer mallory was flagged" in out[0].reason
    assert flag_records.flag_of("eve", flag_records.read(run), roster) is not None
    assert flag_records.flag_of("honest", flag_records.read(run), roster) is None
    # the control: without the roster a flag binds only its name
    assert catalog.admit([eve, good], catalog.Round(run.config, flag_records.read(run)))[1] == []


def test_two_names_of_one_person_never_share_a_part():
    """The pair rule is of people: two names of one key are never both assigned one part, and
    with only them offering, nothing is assigned. Control: counted by name, they share parts."""
    person = {"m1": "K", "m2": "K", "h": "H", "i": "I"}.__getitem__
    offers = ["m1", "m2", "h", "i"]
    assigned = exchange.assign("seed", 64, offers, person)
    assert all(len({person(p) for p in pair}) == 2 for pair in assigned)
    assert exchange.assign("seed", 8, ["m1", "m2"], person) is None
    by_name = exchange.assign("seed", 64, offers)
    assert any(set(pair) == {"m1", "m2"} for pair in by_name)
