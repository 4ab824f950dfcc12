"""A short soak (benchmarks/soak.py, docs/soak.md): 20 rounds with churn on the micro preset in a
process of its own, so the RSS measured is the soak's and not pytest's. Two churn cycles: every kind of event twice,
and both halves of the run in the same phase of the cycle. (40 rounds take ~80 s here; the
300-round figures are in docs/soak.md.) And a short soak with faults (benchmarks/soak_faults.py):
25 rounds on the fake clock with random churn, killed schedulers and aggregators, a full disk and
a failing bucket, every check of the 300-round run asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
ROUNDS = 20

# RSS may grow by at most this much from the first half's peak (after warm-up) to the second
# half's. The process holds 2 to 4 workers as peers come and go, and its peaks moved by +7 to +47
# MB with the churn alone (12, 20 and 300 rounds, docs/soak.md): 100 MB is twice the largest.
# A leak of 10 MB a round (eight fp32 copies of micro's ~0.3M-parameter vector, the unit of what a
# worker or the scheduler holds; one of tiny's) passes it over the second half's 10 rounds; slower
# leaks are for the 300-round run's slope to show.
RSS_GROWTH_MB = 100
# Seed 9's 25 rounds meet every kind of fault: the scheduler killed in 4 steps (commit, apply,
# reduce, try_close), 2 aggregators killed, flaky stretches and a full disk, both kinds of
# departure, workers the bucket failed started again, a volunteer alone for 59 s (seed 7's kills
# fell in 2 steps once a round had no prepare step). (Each concern draws from its own seeded stream,
# so the threads' timing moved none of it in four runs.)
FAULT_ROUNDS, FAULT_SEED = 25, 9


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--rounds", str(ROUNDS), "--preset", "micro",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # exit 1: the soak ran and some check failed (asserted one by one below)
    assert proc.returncode in (0, 1) and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_soak_with_churn_loses_nothing_and_stays_bounded(soak):
    v = soak["verdict"]
    assert soak["rounds"] == ROUNDS
    # the churn happened: peers left, joined, restarted and came back
    kinds = [e["event"] for e in soak["events"]]
    assert {"leave", "join", "restart", "return"} <= set(kinds)
    # nothing lost: COMMIT 0..ROUNDS, CLOSE 0..ROUNDS-1, each COMMIT counts its CLOSE's samples
    assert v["all_commits"] and v["all_closes"] and v["commits_count_their_closes"], soak["checks"]
    assert v["no_shard_rejected"], soak["checks"]["rejected_shards"]  # every peer is honest
    assert v["restarted_streams_continue"], soak["events"]
    assert v["pruned_to_checkpoints"], soak["checks"]
    assert v["loss_fell"], soak["loss"]
    # bounded: fds and threads constant after warm-up, the working set no larger, RSS peaks level
    assert v["fds_constant"], soak["fds"]
    assert v["threads_constant"], soak["threads"]
    assert v["transfer_threads_bounded"], [(x["peers"], x["transfer_threads"]) for x in soak["samples"]]
    assert v["working_set_bounded"], soak["bucket"]
    assert soak["rss_mb"]["growth_second_half_mb"] < RSS_GROWTH_MB, soak["rss_mb"]


@pytest.mark.slow
def test_a_peer_back_after_rounds_away_counts_no_sample_twice(soak):
    """Its manifests are pruned by then: it continues from the latest state's streams record."""
    assert soak["verdict"]["returned_streams_continue"], [e for e in soak["events"] if e["event"] == "return"]
    assert soak["verdict"]["no_sample_counted_twice"], soak["checks"]["samples_counted_twice"]


@pytest.fixture(scope="module")
def faults_soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak-faults") / "soak-faults.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--faults", "--rounds", str(FAULT_ROUNDS),
                           "--preset", "micro", "--seed", str(FAULT_SEED), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1) and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_soak_with_faults_loses_nothing_and_equals_its_replay(faults_soak):
    """Every check of the soak with faults, after the faults really happened."""
    s, by = faults_soak, faults_soak["events_by_kind"]
    assert len(s["phases"]["scheduler_killed"]) >= 3 and by.get("aggregator_killed", 0) >= 1, s["phases"]
    assert by.get("leave", 0) and by.get("vanish", 0) and by.get("restart", 0), by
    assert all(s["faults_injected"].get(k) for k in ("before", "after", "full")), s["faults_injected"]
    assert s["live_s"].get("1"), s["live_s"]  # at times one volunteer alone
    v = s["verdict"]
    assert v["every_round_reached"] and v["all_commits"] and v["all_closes"], (s["stalled"], s["checks"])
    assert v["no_stall"], s["stall"]  # each round closed while someone live could fill it
    assert v["commits_count_their_closes"] and v["commits_list_their_closes"], s["commits_unlisting"]
    assert v["no_sample_counted_twice"], s["checks"]["samples_counted_twice"]
    assert v["streams_cover_counted"], s["streams_uncovered"]
    assert v["no_shard_rejected"], s["checks"]["rejected_shards"]
    assert v["replay_equals_every_state"], s["replay"]  # bit for bit
    assert v["no_unexpected_failure"], s["unexpected"]
    assert v["pruned_to_checkpoints"], s["checks"]
    assert s["ok"]
