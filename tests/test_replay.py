"""Verified work in the local-steps mode: the validator replays a diloco shard's inner steps.

Real lock-step workers of the micro model (``benchmarks.verify.diloco_run``: three honest
volunteers and mallory, delayed updates, a target of 40 so that shards carry stale samples,
steps across the stale boundary and final steps shorter than ``inner_batch``) make the shards;
``Recomputer.replay`` makes each again with a fresh AdamW, the claimed inner steps, the rebase
onto state r and the lr of each step's state. Worst of the 11 honest shards below (1 - cosine,
|norm ratio - 1|), replayed in micro-batches of 7: codec none 5e-12 / 8e-8, int8 8e-6 / 1.1e-4,
int8 from bf16 volunteers replayed in bf16 on this CPU 1.9e-4 / 2.9e-4; docs/verification.md
has the benchmark's figures (the tiny model).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from benchmarks.verify import diloco_run
from dedloc_pipeline.checks import flags, recompute, verify
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.testing import collaborate

MICRO = {}  # small_config's own model: micro


def judged(run, entries):
    """Each shard the scheduler froze (judged it), with its comparison against its replay."""
    rec, out = recompute.Recomputer(run, "cpu", micro_batch=7), []  # another micro-batch than the workers'
    for e in entries:
        try:
            sent = recompute.read_shard(run, e)
        except recompute.Unverifiable:  # late: never judged
            continue
        out.append((e, recompute.tolerance(run.config, e.precision).compare(sent, rec.gradient(e))))
    return out


@pytest.mark.parametrize("codec_name,precision", [("none", "fp32"), ("int8", "fp32"), ("int8", "bf16")])
def test_honest_diloco_shards_replay_to_what_was_sent(bucket, codec_name, precision):
    """Every shard of four honest volunteers matches its replay, stale ones and those whose steps
    cross the stale boundary or end short included. Controls: the same shard replayed as if it had
    no stale samples, or as one inner step, is a mismatch."""
    run, _, entries = diloco_run(codec_name, precision, "honest", rounds=3, size=MICRO, bucket=bucket)
    got = judged(run, entries)
    assert len(got) >= 10 and all(e.precision == precision for e, _ in got)
    tol = recompute.tolerance(run.config, precision)
    assert all(c.matches(tol) for _, c in got), [(e.key, c) for e, c in got if not c.matches(tol)]
    worst = max(1 - c.cosine for _, c in got)
    assert worst < {"none": 1e-9, "int8": 1e-4, "bf16": 5e-3}["bf16" if precision == "bf16" else codec_name]
    crossing = [e for e, _ in got if e.stale_samples and any(
        a < e.stale_samples < b for a, b in zip(np.cumsum([0] + e.inner_steps), np.cumsum(e.inner_steps)))]
    short = [e for e, _ in got if e.inner_steps[-1] < run.config.inner_batch]
    assert crossing and short, "no step across the stale boundary, or no short last step"
    e = crossing[0]
    rec, sent = recompute.Recomputer(run, "cpu"), recompute.read_shard(run, e)
    for wrong in ({"stale_samples": 0}, {"inner_steps": [e.samples]}):
        assert not tol.compare(sent, rec.gradient(e.model_copy(update=wrong))).matches(tol), wrong


def test_a_shard_all_stale_takes_its_last_short_step_on_the_state_that_arrived(make_run):
    """A worker computes 12 samples on state 0 for round 1 (a step after 8), state 1 arrives, and
    the shard is sent at once: its last step, of 4, is taken at the upload, on state 1 (its lr
    and its weight decay). The replay takes it there too. Control: taken before state 1 arrived,
    the pseudo-gradient would be another one, which the replay does not give."""
    from dedloc_pipeline.protocol.shard import DataRef, Entry
    from dedloc_pipeline.volunteer.worker import Worker

    run = make_run(algorithm="diloco", inner_batch=8, keep_states=10,
                   optimizer={"name": "adamw", "lr": 3e-3, "warmup_steps": 2})
    collaborate(run, [("a", 4), ("b", 4)], rounds=1)
    sent = {}
    for when in ("at the upload", "before state 1"):
        w = Worker(run, "z", micro_batch=4, threads=1, delayed=True, poll_s=0)
        w.sync(0)
        for _ in range(3):
            w._compute(1)  # stale: for round 1, on state 0
        if when == "before state 1":
            w.local.inner_step(0)
        w.sync(1)
        sent[when] = w.local.update(1)
        assert w.acc.steps == [8, 4] and w.acc.stale_samples == 12
        ranges = [tuple(x) for x in w.acc.ranges]
    entry = Entry.model_construct(round=1, samples=12, stale_samples=12, inner_steps=[8, 4], precision="fp32",
                                  data=DataRef(stream="z", ranges=ranges))
    replayed = recompute.Recomputer(run, "cpu").gradient(entry)
    tol = recompute.tolerance(run.config)
    assert recompute.compare(sent["at the upload"], replayed).matches(tol)
    assert not recompute.compare(sent["before state 1"], replayed).matches(tol)


@pytest.mark.parametrize("attack", ["reversed", "scaled", "noise", "copied", "poisoned", "honest"])
def test_an_attacked_pseudo_gradient_does_not_match_its_replay(bucket, attack):
    """mallory cheats in every shard (``benchmarks.verify.cheat``): reversed, scaled x8, gaussian
    noise of its norm, alice's pseudo-gradient copied, or inner steps trained on samples 50,000
    past those it claims. Every one of its shards is a mismatch, whether the scheduler's screens
    took it or not; the others' match. Control: mallory honest."""
    run, _, entries = diloco_run("int8", "fp32", attack, rounds=2, size=MICRO, bucket=bucket)
    got = judged(run, entries)
    tol = recompute.tolerance(run.config)
    mallory = [c for e, c in got if e.peer == "mallory"]
    assert mallory and all(c.matches(tol) for e, c in got if e.peer != "mallory")
    assert all(c.matches(tol) != (attack != "honest") for c in mallory), mallory
    if attack == "scaled":
        assert all(c.norm_ratio == pytest.approx(8, rel=0.01) and c.cosine > 0.999 for c in mallory)


@pytest.mark.parametrize("attack", ["reversed", "noise", "honest"])
def test_sparse_shards_are_compared_on_the_entries_they_kept(bucket, attack):
    """A sparse shard keeps 1/64 of its pseudo-gradient plus the volunteer's error feedback
    (never uploaded), so only its kept entries are compared, by direction: reversed and noise
    are mismatches, honest shards match. Control: compared whole, an honest sparse shard would
    not match (cosine about 0.16)."""
    run, _, entries = diloco_run("sparse", "fp32", attack, rounds=2, size=MICRO, bucket=bucket)
    got = judged(run, entries)
    tol = recompute.tolerance(run.config)
    assert tol.kept_only and tol.max_norm_error is None
    assert all(c.matches(tol) == (e.peer != "mallory" or attack == "honest") for e, c in got), got
    e, _ = next((e, c) for e, c in got if e.peer != "mallory")
    whole = recompute.compare(recompute.read_shard(run, e), recompute.Recomputer(run, "cpu").gradient(e))
    assert whole.cosine < tol.min_cosine


@pytest.mark.parametrize("screen", ["sparse runs' 3x", "the default 10x"])
def test_a_scaled_sparse_shard_is_refused_by_the_norm_screen(bucket, screen):
    """A sparse shard's scale is its volunteer's error feedback, which its replay cannot check:
    scaled x8, its kept entries still point the replay's way and match. A sparse run's norm
    screen (3x the round's median volunteer; honest shards within 1.29x in benchmark 4, x8 ones
    at 7.9) refuses it before CLOSE. Control: at the default algorithm's 10x, mallory counts."""
    extra = {} if screen == "sparse runs' 3x" else {"norm_screen": 10.0}
    run, _, _ = diloco_run("sparse", "fp32", "scaled", rounds=2, size=MICRO, bucket=bucket, **extra)
    closes = [Close.read(run, r) for r in range(2)]
    counted = [e for c in closes for e in c.accepted if e.peer == "mallory"]
    refused = [x for c in closes for x in c.rejected if "/mallory/" in x.key and "gradient norm" in x.reason]
    if screen == "sparse runs' 3x":
        assert len(refused) >= 2 and not counted, (refused, counted)
    else:
        assert counted and not refused, (refused, counted)


@pytest.mark.parametrize("inner_state", ["kept", "shard"])
def test_shards_of_a_kept_inner_optimizer_are_unverified(make_run, inner_state):
    """inner_state kept: a shard depends on the volunteer's inner optimizer state, which never
    leaves it, so it is unverified, held against nobody. Control: inner_state shard, verified."""
    run = make_run(algorithm="diloco", inner_batch=8, inner_state=inner_state, keep_states=10)
    collaborate(run, [("a", 4), ("b", 3)], rounds=1)
    shards = verify.Verifier(run, fraction=1.0, device="cpu").verify_round(0)["shards"]
    want = "unverified" if inner_state == "kept" else "ok"
    assert shards and all(s["verdict"] == want and not s["flag"] for s in shards), shards
    assert ("inner_state kept" in shards[0]["reason"]) == (inner_state == "kept")
    assert flags.read(run) == {}


def test_the_pair_rule_holds_honest_shards_drifting_together_and_not_other_samples():
    """Kept entries' cosines measured in one 20-round tiny run (honest a and c, poisoned mallory,
    each with an honest reference of its round): honest shards drift together from 1.0 to 0.944,
    so neither is short of the other (benchmark 4 put a round's least matching honest shard at
    most 3.9 times as far from 1 as its best, under ``pair_spread``); the poisoned ones are short
    of an honest one early in the run, and the last one measured, 3.2 times as far, no longer:
    late in a run work on other samples comes within the honest spread. Controls: a fixed bound
    (0.95) would have flagged honest a in round 17, and the spread of 2 this rule had first would
    have called a round's least matching honest shard short of its best in 2 of 56 rounds."""
    tol = recompute.REPLAY_TOLERANCES["sparse"]
    honest = [(0.9998, 0.9999), (0.9909, 0.9927), (0.9811, 0.9801), (0.9436, 0.9509), (0.9463, 0.9447)]
    assert not any(tol.short_of(x, y) or tol.short_of(y, x) for x, y in honest)
    poisoned = [(0.6229, 1.0), (0.7841, 0.9992), (0.8252, 0.9801)]
    assert all(tol.short_of(x, ref) for x, ref in poisoned)
    assert not tol.short_of(0.9269, 0.9769)
    assert 0.9436 < 0.95 <= 0.9509
    assert 3.9 < tol.pair_spread and replace(tol, pair_spread=2).short_of(1 - 3.9 * 0.005, 0.995)
