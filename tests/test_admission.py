"""The close's admission rules, each alone: CLOSE entries in, (kept, rejected with the reason) out."""

from __future__ import annotations

import pytest

from dedloc_pipeline.checks import admission
from dedloc_pipeline.checks.flags import Flag
from dedloc_pipeline.protocol.close import Rejection
from dedloc_pipeline.protocol.shard import DataRef, Entry


def entry(peer: str, part: str = "0001", samples: int = 8, start: int = 0, norm: float = 1.0,
          late: bool = False) -> Entry:
    return Entry(key=f"{peer}/{part}", peer=peer, part=part, round=1, samples=samples, loss=5.0, stale_samples=0,
                 checksums={"values": ["0" * 16]}, data=DataRef(stream=peer, ranges=[(start, samples)]), norm=norm,
                 late=late, manifest_sha="0" * 64)


def keys(entries) -> list[str]:
    return [e.key for e in entries]


# parts

def test_a_volunteers_parts_beyond_max_parts_are_rejected_all_its_peers_together():
    shards = [entry("a.gpu", "0002", start=8), entry("b"), entry("a.gpu"), entry("a.cpu")]
    kept, out = admission.bound_parts(shards, max_parts=2)
    assert keys(kept) == ["a.cpu/0001", "a.gpu/0001", "b/0001"]  # by peer, then part: the first ones count
    assert out == [Rejection(key="a.gpu/0002", reason="part 3 of volunteer a this round, above close.max_parts=2")]


def test_a_peers_late_shards_count_before_its_parts_of_the_round():
    kept, out = admission.bound_parts([entry("a", "0001", start=8), entry("a", "0009", late=True)], max_parts=1)
    assert keys(kept) == ["a/0009"] and keys(out) == ["a/0001"]


def test_two_parts_over_the_same_samples_count_once_and_the_copy_takes_no_part():
    shards = [entry("a", "0001"), entry("a", "0002", samples=4, start=4), entry("a", "0003", start=8)]
    kept, out = admission.bound_parts(shards, max_parts=2)
    assert keys(kept) == ["a/0001", "a/0003"]
    assert out == [Rejection(key="a/0002", reason="samples 4.. of a were already counted this round by another "
                                                  "part (0+8)")]


def test_the_same_samples_of_different_streams_do_not_overlap():
    kept, out = admission.bound_parts([entry("a"), entry("b")], max_parts=1)
    assert keys(kept) == ["a/0001", "b/0001"] and out == []


# the norm screen

def test_a_shard_far_above_the_median_volunteers_norm_is_rejected():
    shards = [entry("a"), entry("b"), entry("c"), entry("d", norm=10.0)]
    kept, out = admission.norm_screen(shards, factor=3.0)
    assert keys(kept) == ["a/0001", "b/0001", "c/0001"]
    assert out == [Rejection(key="d/0001", reason="gradient norm 10 (10 at the typical shard's samples) above 3x "
                                                  "the round's median volunteer (3)")]


def test_the_screen_compares_norms_at_the_typical_shards_samples():
    """A mean over 2 samples is noisier: norm 2 at 2 samples is norm 1 at the typical 8; a shard
    over more samples than typical is never scaled up."""
    shards = [entry("a"), entry("b"), entry("c", samples=2, norm=2.0), entry("d", samples=32, norm=2.9)]
    kept, out = admission.norm_screen(shards, factor=3.0)
    assert keys(kept) == keys(shards) and out == []


def test_one_volunteers_many_parts_move_the_median_no_more_than_one():
    """Medians over volunteers: m's five parts at norm 100 are one row, so the median volunteer's
    norm stays 1 (over shards it would be 100, and nothing would be screened)."""
    shards = [entry("a"), entry("b", norm=3.5), entry("c"), entry("d")]
    shards += [entry("m", f"000{i}", start=8 * i, norm=100.0) for i in range(5)]
    kept, out = admission.norm_screen(shards, factor=3.0)
    assert keys(kept) == ["a/0001", "c/0001", "d/0001"]
    assert keys(out) == ["b/0001"] + [f"m/000{i}" for i in range(5)]


def test_the_screen_is_off_without_a_factor_or_three_volunteers():
    shards = [entry("a"), entry("b", norm=100.0)]
    assert admission.norm_screen(shards, factor=3.0) == (shards, [])
    assert admission.norm_screen(shards + [entry("c")], factor=None) == (shards + [entry("c")], [])


# flags

def test_a_flagged_volunteers_shards_are_refused_from_every_peer():
    shards = [entry("alice"), entry("mallory.gpu"), entry("mallory.cpu")]
    flag = Flag(volunteer="mallory", peer="mallory.gpu", round=3, verdict="mismatch", reason="differs", flagged_at=0)
    kept, out = admission.unflagged(shards, {"mallory": flag})
    assert keys(kept) == ["alice/0001"]
    reason = "volunteer mallory was flagged by the validator in round 3: differs"
    assert out == [Rejection(key="mallory.gpu/0001", reason=reason), Rejection(key="mallory.cpu/0001", reason=reason)]
    assert admission.unflagged(shards, {}) == (shards, [])
    wrong = flag.model_copy(update={"verdict": "wrong part"})
    _, out = admission.unflagged(shards, {"mallory": wrong})
    assert "flagged by the scheduler, as an aggregator, in round 3" in out[0].reason


# weights

def test_honest_volunteers_keep_their_exact_weights():
    weighted, samples, _ = admission.weigh([entry("a", samples=4), entry("b"), entry("c", samples=12)], 24, 0.1)
    assert [e.weight for e in weighted] == [4.0, 8.0, 12.0] and samples == 24


def test_a_claim_counts_for_twice_the_median_volunteer_its_parts_scaled_alike():
    shards = [entry("a"), entry("b"), entry("c"), entry("m", "0001", 48), entry("m", "0002", 48, start=48)]
    weighted, samples, _ = admission.weigh(shards, target=24, max_share=0.1)
    assert [e.weight for e in weighted] == [8.0, 8.0, 8.0, 8.0, 8.0]  # m: 96 claimed, capped at 2 x 8
    assert samples == 16 + 24
    assert [e.weight for e in shards] == [None] * 5  # the entries given are left as they were


def test_the_first_shard_of_a_round_is_capped_by_the_volunteers_still_computing():
    """Alone, m's claim would fill the round; counted with the three volunteers heartbeating (or of
    the state it builds on), it counts for twice its fair share of the target: 2 x 24 / 4."""
    (alone,), samples, _ = admission.weigh([entry("m", samples=96)], 24, 0.1)
    assert alone.weight == 96.0 and samples == 96
    (capped,), samples, cap = admission.weigh([entry("m", samples=96)], 24, 0.1, others={"a", "b", "c"})
    assert capped.weight == 12.0 and samples == 12 and cap == 12


def test_a_first_round_counts_the_enrolled_volunteers_up_to_three_through_its_grace():
    """With no state contributors to count, a first round counts at least min(3, enrolled)
    volunteers for ``grace_s`` after its first work: one alone weighs 2 x 24 / 3; three honest
    ones are not capped; after the grace, or with fewer enrolled, one alone fills the round."""
    assert admission.least_volunteers([], 5, 100.0, 129.0, 30.0) == 3
    assert admission.least_volunteers([], 2, 100.0, 129.0, 30.0) == 2
    assert admission.least_volunteers([], 5, 100.0, 130.0, 30.0) == 0  # the grace passed
    assert admission.least_volunteers(["a"], 5, 100.0, 101.0, 30.0) == 0  # later rounds: present()
    (capped,), samples, cap = admission.weigh([entry("m", samples=96)], 24, 0.1, least=3)
    assert capped.weight == 16.0 and samples == 16 and cap == 16
    honest = [entry("a", samples=4), entry("b"), entry("c", samples=12)]
    assert admission.weigh(honest, 24, 0.1, least=3).samples == 24


def test_the_cap_is_never_below_max_share_of_the_target():
    many = [entry(f"v{i:02d}", samples=1) for i in range(40)] + [entry("m", samples=10)]
    weighted, samples, _ = admission.weigh(many, target=100, max_share=0.05)
    assert weighted[-1].weight == 5.0 and samples == 40 + 5  # 2/V and 2 x median are below 5% of 100


# lateness and the close rule

def test_late_shards_are_folded_marked_late():
    shards = [entry("a"), entry("b")]
    assert [e.late for e in admission.folded(shards)] == [True, True]
    assert [e.model_copy(update={"late": False}) for e in admission.folded(shards)] == shards
    assert [e.late for e in shards] == [False, False]


@pytest.mark.parametrize("samples,expired,met", [(24, False, True), (23, False, False), (12, True, True),
                                                 (11, True, False), (30, True, True)])
def test_a_round_closes_at_its_target_or_once_expired_at_min_fraction(samples, expired, met):
    assert admission.closes(samples, 24, 0.5, expired) is met


def test_a_round_expires_after_timeout_s_or_never():
    assert admission.timed_out(100.0, 105.0, 5.0) and not admission.timed_out(100.0, 104.9, 5.0)
    assert not admission.timed_out(100.0, 1e9, None)


# the direction screen (local-steps mode)

def test_a_large_shard_is_sketched_on_chunks_no_volunteer_can_know():
    """A small vector is sketched whole; a large one on 8 chunks drawn per round from this
    process's secret: the same for every shard of a round, another in the next round, another in
    another scheduler process (so nobody can reverse only the chunks left unsketched)."""
    import subprocess
    import sys

    from dedloc_pipeline.checks import direction
    assert direction.sampled(5, 3) == [0, 1, 2, 3, 4]
    here = direction.sampled(120, 3)
    assert len(here) == 8 == len(set(here)) and here == direction.sampled(120, 3) != direction.sampled(120, 4)
    code = "from dedloc_pipeline.checks import direction; print(direction.sampled(120, 3))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() != str(here)


def test_the_direction_screen_rejects_the_volunteer_pointing_away_from_the_median():
    """Sketches of three volunteers near one direction and one reversed: only the reversed one
    is rejected; with two volunteers, or the screen off, nobody is."""
    import numpy as np
    rng = np.random.default_rng(0)
    base = rng.standard_normal(4096)
    shards = [entry(p) for p in ("a", "b", "c", "m")]
    for s, sign in zip(shards, (1, 1, 1, -8)):
        s._sketch = sign * base + rng.standard_normal(4096)
    kept, out = admission.direction_screen(shards, 0.0)
    assert keys(kept) == ["a/0001", "b/0001", "c/0001"] and [r.key for r in out] == ["m/0001"]
    assert admission.direction_screen(shards[2:], 0.0) == (shards[2:], [])  # two volunteers: no majority
    assert admission.direction_screen(shards, None) == (shards, [])
