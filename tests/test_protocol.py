"""The round protocol's invariants, driven in one process against a real local bucket."""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dedloc_pipeline.compute import aggregation
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import shard
from dedloc_pipeline.protocol.run import Run, RunError, init_run
from dedloc_pipeline.storage import codec, vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import collaborate, stream_next, written
from dedloc_pipeline.volunteer import upload_policy
from dedloc_pipeline.volunteer.worker import Worker

from .conftest import small_config


def put_shard(run, r, peer, grad=None, samples=4, part="0001", manifest=None):
    """Upload a hand-made shard (chunks, then manifest), optionally with manifest fields forced;
    its samples follow the peer's stream."""
    grad = np.full(run.flat.n, 1e-4, np.float32) if grad is None else grad
    arrays = codec.encode(grad, run.config.codec, run.config.block_size)
    key = shard.upload(run, r, peer, part, arrays, samples, 5.0,
                       shard.DataRef(stream=peer, ranges=[(stream_next(run, r, peer), samples)]))
    if manifest:
        m = run.bucket.read_json(run.keys.manifest(key))
        m.update(manifest)
        run.bucket.write_json(run.keys.manifest(key), m)
    return key


def finish(run, r):
    with ThreadPoolExecutor(2) as pool:
        return Scheduler(run, 2, 0).finish(r, pool)


# invariant 1: data first, marker last; only markers are trusted

def test_markers_are_written_after_their_data(make_run):
    run = make_run()
    collaborate(run, [("a", 4), ("b", 3)], rounds=2)
    root = run.bucket.root

    def mtime(key):
        return os.stat(os.path.join(root, key)).st_mtime_ns

    keys = run.bucket.find(run.keys.root)
    for r in range(2):
        for s in run.bucket.read_json(run.keys.close(r))["accepted"]:
            if r < run.latest() - 1:  # pruned from the volunteers' prefixes; the frozen copy stays
                assert not [k for k in keys if k.startswith(s["key"] + "/")]
                assert [k for k in keys if k.startswith(run.keys.frozen(s["key"]) + "/")]
                continue
            data = [k for k in keys if k.startswith(s["key"] + "/")]
            assert data and max(map(mtime, data)) <= mtime(run.keys.manifest(s["key"]))
            assert mtime(run.keys.manifest(s["key"])) <= mtime(run.keys.close(r))
        state = run.keys.state(r + 1)
        written = [k for k in keys if k.startswith(state + "/") and not k.endswith("COMMIT.json")]
        assert max(map(mtime, written)) <= mtime(run.keys.commit(r + 1))
    assert mtime(run.keys.commit(2)) <= mtime(run.keys.latest)


def test_shard_without_manifest_is_never_read(make_run):
    run = make_run()
    torn = run.keys.shard(0, "torn", "0001")
    vector.write_vector(run.bucket, torn, run.grad_format,
                       codec.encode(np.full(run.flat.n, np.nan, np.float32), "none", 4096))
    put_shard(run, 0, "good", samples=24)
    close = Scheduler(run, 1, 0).try_close(0)
    assert [s.peer for s in close.accepted] == ["good"] and close.rejected == []


# invariant 2: validation at close

# (each check's attacks: tests/test_checks.py)


def test_a_shard_that_breaks_the_judge_is_rejected_and_the_round_goes_on(make_run, monkeypatch, caplog):
    """Any exception while one shard is judged (here a MemoryError out of its norm) rejects that
    shard, logged with the reason; the scheduler and the round go on."""
    run = make_run(max_grad_norm=100.0)
    put_shard(run, 0, "honest", samples=24)
    put_shard(run, 0, "odd", grad=np.full(run.flat.n, 3e-4, np.float32))
    norm = codec.squared_norm

    def squared_norm(arrays, *a):
        if np.allclose(codec.decode(arrays, run.config.codec, run.config.block_size)[:4], 3e-4):
            raise MemoryError("out of memory")
        return norm(arrays, *a)

    monkeypatch.setattr(codec, "squared_norm", squared_norm)
    with caplog.at_level(logging.WARNING, logger="dedloc_pipeline.organizer.scheduler"):
        close = Scheduler(run, 1, 0).try_close(0)
    assert [s.peer for s in close.accepted] == ["honest"]
    assert close.rejected[0].reason == "could not be judged: MemoryError: out of memory"
    assert any("could not be judged" in r.message for r in caplog.records)


def test_round_waits_for_the_target_then_closes(make_run):
    run = make_run()
    sched = Scheduler(run, 1, 0)
    put_shard(run, 0, "a", samples=12)
    assert sched.try_close(0) is None and not run.bucket.exists(run.keys.close(0))
    put_shard(run, 0, "b", samples=12)
    assert sched.try_close(0).samples == 24


def test_timeout_closes_a_short_round_above_the_minimum(make_run):
    run = make_run(close={"timeout_s": 5, "min_fraction": 0.5})
    sched = Scheduler(run, 1, 0)
    opened = run.commit_of(0)["committed_at"]
    put_shard(run, 0, "a", samples=8)
    assert sched.try_close(0, now=opened + 10) is None  # 8 < half of 24
    put_shard(run, 0, "b", samples=4)
    assert sched.try_close(0, now=opened + 1) is None  # not timed out yet
    close = sched.try_close(0, now=opened + 10)
    assert close.samples == 12 and close.reason == "timeout"


# late shards

@pytest.mark.parametrize("policy", ["reject", "fold"])
def test_late_shard_never_joins_its_closed_round(make_run, policy):
    run = make_run(close={"late_shards": policy})
    put_shard(run, 0, "a", samples=24)
    finish(run, 0) if Scheduler(run, 1, 0).try_close(0) else None
    late = put_shard(run, 0, "slow", samples=4, grad=np.full(run.flat.n, 3e-4, np.float32))
    assert late not in [s["key"] for s in run.bucket.read_json(run.keys.close(0))["accepted"]]
    put_shard(run, 1, "a", samples=24)
    close1 = Scheduler(run, 1, 0).try_close(1)
    folded = [s for s in close1.accepted if s.key == late]
    if policy == "fold":
        assert folded and folded[0].late and close1.samples == 28
    else:  # not counted, but its samples are spent: its stream moves past them
        assert not folded and close1.samples == 24
        (missed,) = [x for x in close1.missed if x.key == late]
        assert late not in close1.listed()  # neither accepted nor rejected: round 1 never judged it
        assert "missed the CLOSE of round 0" in missed.reason and missed.data.ranges == [(0, 4)]
    commit = finish(run, 1)
    assert ("slow" in commit["contributors"]) == (policy == "fold")
    assert run.bucket.read_json(run.keys.close(0))["samples"] == 24  # round 0 untouched
    assert run.stream_ends(2)["slow"] == 4


def test_an_honest_worker_whose_shards_keep_missing_their_rounds_is_not_refused_for_the_gaps(make_run):
    """A slow worker's shards miss round after round (policy ``reject``): each one's samples are
    spent though never counted, so when one lands in time it starts where its stream was left,
    within the stream window, and counts. Control: were missed samples not spent, the gaps would
    add up past the window (``validation.stream_window``) and its honest shard be refused."""
    from dedloc_pipeline.checks.validation import stream_window
    run = make_run()
    window, start = stream_window(run), 0
    r = 0
    while start <= window:  # its shards miss every round until the gaps alone exceed the window
        put_shard(run, r, "a", samples=24)
        assert Scheduler(run, 1, 0).try_close(r)
        finish(run, r)
        put_shard(run, r, "slow", samples=20, manifest={"data": {"stream": "slow", "ranges": [[start, 20]]}})
        start, r = start + 20, r + 1
    put_shard(run, r, "a", samples=12)
    put_shard(run, r, "slow", samples=12, manifest={"data": {"stream": "slow", "ranges": [[start, 12]]}})
    close = Scheduler(run, 1, 0).try_close(r)
    assert sorted(e.peer for e in close.accepted) == ["a", "slow"], close.rejected



# invariant 4: idempotent, restartable, committed once

def _fill_round(run, r, peers=(("a", 4), ("b", 3), ("c", 5))):
    for i, (name, n) in enumerate(peers):
        g = np.random.default_rng(r * 10 + i).standard_normal(run.flat.n).astype(np.float32) * 1e-3
        put_shard(run, r, name, grad=g, samples=8 + n)


@pytest.mark.parametrize("crash_after", ["close", "one_reduce", "all_reduce", "one_apply", "all_apply"])
@pytest.mark.slow
def test_scheduler_killed_between_close_and_commit_gives_the_same_state(tmp_path, crash_after):
    cfg = small_config(codec="int8", optimizer={"name": "lamb"})
    ref, crashed = Bucket(str(tmp_path / "ref")), Bucket(str(tmp_path / "crash"))
    ref_run = init_run(ref, cfg)
    _fill_round(ref_run, 0)
    shutil.copytree(ref.root, crashed.root, dirs_exist_ok=True)
    run = Run(crashed, cfg.run)
    assert Scheduler(ref_run, 1, 0).try_close(0)
    finish(ref_run, 0)

    # the first scheduler gets this far, then dies
    Scheduler(run, 1, 0).try_close(0)
    parts = range(run.n_parts)
    if crash_after != "close":
        for k in (parts[:1] if crash_after == "one_reduce" else parts):
            aggregation.reduce_part(run, 0, k)
    if crash_after in ("one_apply", "all_apply"):
        for k in (parts[:1] if crash_after == "one_apply" else parts):
            aggregation.apply_part(run, 0, k)
    assert not crashed.exists(run.keys.commit(1))
    # a new scheduler, knowing nothing but the bucket
    with ThreadPoolExecutor(2) as pool:
        assert Scheduler(Run(crashed, cfg.run), 2, 0).step(pool)
    assert run.latest() == 1
    for name in ("params", "delta/codes", "optim/exp_avg", "optim/exp_avg_sq", "optim/residual"):
        a = run.keys.state(1) + f"/{name}"
        assert sorted(ref.find(a)) == sorted(crashed.find(a))
        for key in ref.find(a):
            assert ref.read_bytes(key) == crashed.read_bytes(key), key
    assert ref_run.commit_of(1)["checksums"] == run.commit_of(1)["checksums"]


def test_the_organizer_steps_from_what_it_wrote_as_from_the_bucket(tmp_path, monkeypatch):
    """The organizer keeps the reduced gradient and the state it wrote (``vector.Kept``) and
    steps from them, reading neither back: the same states, bit for bit, as a scheduler that
    holds nothing. A part whose marker names other checksums (another process rewrote it) is
    read from the bucket."""
    cfg = small_config(codec="int8")
    kept, plain = (init_run(Bucket(str(tmp_path / name)), cfg) for name in ("kept", "plain"))
    plain.kept = vector.Kept(limit_bytes=0)  # holds nothing: every step reads the bucket
    read, real = [], vector.read_vector
    monkeypatch.setattr(vector, "read_vector", lambda bucket, key, fmt, chunks=None, *a, **kw: (
        read.append((bucket.root, key, chunks)) or real(bucket, key, fmt, chunks, *a, **kw)))

    def stepped(run, rounds):  # the reduced gradients and optimizer states read, by (key, chunks)
        scheduler = Scheduler(run, 2, 0)
        with ThreadPoolExecutor(2) as pool:
            for r in rounds:
                _fill_round(run, r)
                scheduler.finish(r, pool, scheduler.try_close(r))
        return {(k, c.start) for b, k, c in read if b == run.bucket.root and ("/reduced/" in k or "/optim/" in k)}

    assert kept.n_parts > 1
    assert stepped(kept, range(3)) == {(kept.keys.optim(0, n), kept.part_chunks(k).start)  # state 0 has no marker
                                       for n in ("exp_avg", "exp_avg_sq", "residual") for k in range(kept.n_parts)}
    assert {k for k, _ in stepped(plain, range(3))} == {
        *(plain.keys.reduced(r) for r in range(3)),
        *(plain.keys.optim(s, n) for s in range(3) for n in ("exp_avg", "exp_avg_sq", "residual"))}
    assert [kept.commit_of(s)["checksums"] for s in (1, 2, 3)] == [plain.commit_of(s)["checksums"] for s in (1, 2, 3)]
    marker = kept.bucket.read_json(kept.keys.applied(3, 0))
    marker["vectors"]["exp_avg"]["values"][0] = "0" * 32  # as if rewritten since
    kept.bucket.write_json(kept.keys.applied(3, 0), marker)
    read.clear()
    assert {(k, c) for k, c in stepped(kept, [3]) if "/optim/" in k} == {
        (kept.keys.optim(3, n), 0) for n in ("exp_avg", "exp_avg_sq", "residual")}
    stepped(plain, [3])
    assert kept.commit_of(4)["checksums"] == plain.commit_of(4)["checksums"]


def test_two_schedulers_commit_each_state_once(make_run):
    run = make_run(codec="int8")
    _fill_round(run, 0)
    s1, s2 = Scheduler(run, 1, 0), Scheduler(Run(run.bucket, run.name), 1, 0)
    c1, c2 = s1.try_close(0), s2.try_close(0)
    assert c1 == c2
    with ThreadPoolExecutor(2) as pool:
        a = s1.finish(0, pool)
        b = s2.finish(0, pool)
        assert a == b and s1.step(pool) is False  # round 1 is open and empty
    assert run.latest() == 1 and run.bucket.read_json(run.keys.latest) == {"state": 1}
    commit = run.bucket.read_bytes(run.keys.commit(1))
    finish(run, 0)  # finishing a committed round again changes nothing
    assert run.bucket.read_bytes(run.keys.commit(1)) == commit


def test_latest_is_a_hint_and_commits_are_the_truth(make_run):
    run = make_run()
    _fill_round(run, 0)
    Scheduler(run, 1, 0).try_close(0)
    finish(run, 0)
    run.bucket.write_json(run.keys.latest, {"state": 0})  # a stale pointer (crash before LATEST)
    assert run.latest() == 1
    run.bucket.write_json(run.keys.latest, {"round": 0})  # as buckets before the rename wrote it
    assert run.latest() == 1
    run.bucket.write_json(run.keys.latest, {"round": "x"})
    with pytest.raises(RunError, match="no state number"):
        run.latest()


# peers: download, join, restart

@pytest.mark.slow
def test_synced_peers_rebuild_each_state_from_its_delta(make_run):
    run = make_run(codec="int8")
    workers = collaborate(run, [("a", 4), ("b", 3)], rounds=4)
    latest = run.latest()
    for w in workers:
        w.sync()
        assert w.params.tobytes() == run.load_params(latest).tobytes()
    delta = sum(os.path.getsize(os.path.join(run.bucket.root, k)) for k in run.bucket.find(run.keys.delta(latest)))
    snap = sum(os.path.getsize(os.path.join(run.bucket.root, k)) for k in run.bucket.find(run.keys.params(latest)))
    assert delta < snap / 3  # peers download about a byte per parameter, not four


@pytest.mark.slow
def test_a_peer_that_joins_later_pulls_the_snapshot_and_contributes(make_run):
    run = make_run()
    collaborate(run, [("a", 4), ("b", 3)], rounds=2)
    workers = collaborate(run, [("a", 4), ("b", 3), ("late", 4)], rounds=4)
    assert workers[2].sync() and workers[2].state == 4
    assert workers[2].params.tobytes() == run.load_params(4).tobytes()
    assert "late" in run.commit_of(3)["contributors"] + run.commit_of(4)["contributors"]


@pytest.mark.slow
def test_a_restarted_peer_continues_its_data_stream(make_run):
    run = make_run()
    collaborate(run, [("a", 4), ("b", 4)], rounds=2)
    collaborate(run, [("a", 4), ("b", 4)], rounds=4)  # same peer ids, new processes
    seen = []
    for r in range(4):
        for s in run.bucket.read_json(run.keys.close(r))["accepted"]:
            if s["peer"] == "a":
                seen += [i for start, n in s["data"]["ranges"] for i in range(start, start + n)]
    assert len(seen) == len(set(seen))  # no sample counted twice


@pytest.mark.slow
def test_a_peer_back_after_its_manifests_were_pruned_continues_its_stream(make_run):
    """Found by the soak: the returning peer's manifests are gone with their rounds; the
    latest state's streams record still says where its stream is counted up to."""
    run = make_run(keep_states=2)
    collaborate(run, [("a", 4), ("b", 4)], rounds=2)
    collaborate(run, [("b", 4), ("c", 4)], rounds=4)  # a is away; its rounds are pruned
    assert run.bucket.find(run.keys.manifests_dir(0, "a")) == []
    collaborate(run, [("a", 4), ("b", 4)], rounds=6)
    seen = []
    for r in range(6):
        for s in run.bucket.read_json(run.keys.close(r))["accepted"]:
            if s["peer"] == "a":
                seen += [i for start, n in s["data"]["ranges"] for i in range(start, start + n)]
    assert len(seen) == len(set(seen)) and max(seen) >= 24


def test_a_bucket_of_another_layout_version_is_refused_untouched(bucket):
    bucket.write_json("runs/old/run.json", {"layout_version": 0, "run": "old"})
    before = bucket.find("runs")
    with pytest.raises(RunError, match="layout v0"):
        Run(bucket, "old")
    assert bucket.find("runs") == before


def test_init_is_idempotent_and_refuses_another_config(bucket):
    run = init_run(bucket, small_config())
    p0 = run.load_params(0)
    again = init_run(bucket, small_config())
    assert again.load_params(0).tobytes() == p0.tobytes()
    with pytest.raises(RunError, match="another config"):
        init_run(bucket, small_config(target_batch_size=99))


def test_missing_run_is_a_clear_error(bucket):
    with pytest.raises(RunError, match="no run 'nope'"):
        Run(bucket, "nope")


@pytest.mark.slow
def test_old_rounds_are_pruned_but_the_ledger_and_checkpoints_stay(make_run):
    run = make_run(keep_states=2, checkpoint_every=3)
    collaborate(run, [("a", 4), ("b", 3)], rounds=7)
    b, k = run.bucket, run.keys
    for s in range(8):
        assert b.exists(k.commit(s))
    for r in range(7):
        assert b.exists(k.close(r))
    # states 1..5 are older than the last 2: only checkpoints 0 and 3 keep their parameters
    assert [s for s in range(6) if b.find(k.params(s))] == [0, 3]
    assert run.load_params(3).shape == (run.flat.n,)
    # the volunteers' prefixes keep the rounds from the last closed one on; the frozen copies, the last 2 states'
    assert [r for r in range(8) if written(run, r, "object")] == [6]
    assert not b.find(k.round(4) + "/frozen") and b.find(k.round(5) + "/frozen")
    assert not b.find(k.delta(4)) and b.find(k.delta(7))
    from dedloc_pipeline.monitoring.status import status
    assert [h["round"] for h in status(run)["history"]] == list(range(7))


@pytest.mark.parametrize("delayed", [True, False])
def test_delayed_updates_keep_computing_while_a_round_is_reduced(make_run, delayed):
    """Invariant 5: a full, uncommitted round does not stall a delayed-update worker."""
    run = make_run(delayed_updates=delayed)
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0)
    put_shard(run, 0, "other", samples=24)  # the round is full ...
    Scheduler(run, 1, 0).try_close(0)  # ... closed, its round view published; nobody reduces it
    worked = []
    for _ in range(3):
        worked.append(w.step())
        w.flush()
    assert worked == [delayed] * 3
    if delayed:
        assert w.acc.round == 1 and w.acc.stale_samples == w.acc.samples == 12
        progress = run.bucket.read_json(run.keys.progress(1, "a"))
        assert progress["samples"] == 12  # and the others can count them toward round 1
        finish(run, 0)
        Scheduler(run, 1, 0).try_close(1)  # the scheduler's next poll: the view names state 1
        w.step()
        w.flush()
        # state 1 downloads beside that micro-batch, which is one more on state 0 (stale) ...
        assert w.state == 1 and w.acc.round == 1 and w.acc.samples == 16 and w.acc.stale_samples == 16
        w.step()  # ... and the next is on state 1
        assert w.acc.samples == 20 and w.acc.stale_samples == 16
    else:
        assert w.acc is None and w.computed_samples == 0


def test_stop_marker_sends_workers_and_scheduler_home(make_run):
    from typer.testing import CliRunner

    from dedloc_pipeline.cli import app
    run = make_run()
    collaborate(run, [("a", 4)], rounds=1)
    res = CliRunner().invoke(app, ["stop", "--bucket", run.bucket.url, "--run", run.name])
    assert res.exit_code == 0 and "STOP" in res.output
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0)
    assert w.serve(until_round=5) == 1 and w.stopped and w.computed_samples == 0
    assert Scheduler(run, 1, 0).serve(until_round=5) == 1


@pytest.mark.parametrize("manifests,fresh,mine,first,upload", [
    (0, 16, 8, True, True),     # the round can fill: everyone uploads what they have
    (0, 8, 8, True, False),     # not yet
    (16, 8, 4, False, False),   # after my part: the others' pending parts will fill it
    (16, 8, 8, False, True),    # my pending alone covers what the manifests lack
    (16, 0, 8, False, True),    # a peer vanished (no fresh progress): mine is needed now
    (16, 2, 4, False, False),   # still short even with mine: keep computing
])
def test_when_a_worker_uploads(manifests, fresh, mine, first, upload):
    from dedloc_pipeline.protocol.view import RoundView
    v = RoundView(manifest_samples=manifests, fresh_samples=fresh)
    assert upload_policy.should_upload(v, mine, target=24, first=first) is upload


# the round engine: one loop, whichever driver

def test_a_round_closed_before_stop_is_still_committed(make_run):
    """STOP after a CLOSE: the loop commits the closed round, then ends (both drivers share
    stop_reason); a wall-time deadline behaves the same."""
    from dedloc_pipeline.organizer.scheduler import stop_reason
    run = make_run()
    _fill_round(run, 0)
    sched = Scheduler(run, 1, 0)
    assert sched.try_close(0) is not None
    run.bucket.create_json(run.keys.stop(), {"reason": "test"})
    snap = sched.poll()
    assert snap.stopped and snap.close is not None and stop_reason(snap, deadline=0.0, now=1.0) is None
    assert sched.serve(until_round=5) == 1 and run.commit_of(1)["samples"] >= 24
    assert stop_reason(sched.poll(), deadline=0.0, now=1.0) == "wall time"
    assert stop_reason(sched.poll()) == "STOP marker" and stop_reason(sched.poll(), until_state=1) == "rounds"


def test_the_verdict_cache_stays_bounded_when_the_flow_drives_the_steps(make_run):
    """The Prefect flow runs the steps as separate tasks (never Scheduler.step): its long-lived
    scheduler still forgets verdicts of rounds that no close will ask about again."""
    from dedloc_pipeline.organizer import ledger
    run = make_run()
    sched = Scheduler(run, 1, 0)
    for r in range(4):
        _fill_round(run, r)
        assert sched.wait_close(r) is not None
        for step in (aggregation.reduce_part, aggregation.apply_part):
            for k in range(run.n_parts):
                step(run, r, k)
        ledger.commit(run, r)
        assert {run.keys.round_of(k) for k in sched.judge.seen} == ({r - 1, r} if r else {0})


def test_a_closed_round_ends_in_one_order_whoever_drives_it():
    """``close_out`` (what Scheduler.finish and the Prefect round flow both run): settle, then the
    organizer reduces and steps only the parts left, flags liars with its answers known, commits,
    with each step's seconds by the driver's clock."""
    from dedloc_pipeline.organizer.close_out import CloseOut, close_out
    from dedloc_pipeline.organizer.referee import Settlement
    calls: list = []
    settled = Settlement(agreed={1: ["a", "b"]})
    clock = iter(range(100))  # each step takes a tick more than the one before, each reading of it one
    ticks = {"settle": 1, "reduce": 2, "apply": 3, "flag": 4}

    def step(name, value=None):
        def run(*args):
            calls.append((name, *args))
            for _ in range(ticks[name]):
                next(clock)
            return value
        return run
    steps = CloseOut(settle=step("settle", settled), reduce=step("reduce"), apply=step("apply"),
                     flag_liars=step("flag"), commit=lambda stages: calls.append(("commit", stages)) or {"s": 1})
    assert close_out(3, steps, clock=lambda: float(next(clock))) == {"s": 1}
    assert calls[:-1] == [("settle",), ("reduce", [0, 2]), ("apply", [0, 2]), ("flag", settled)]
    assert calls[-1] == ("commit", {"settle_s": 2.0, "reduce_s": 3.0, "apply_s": 4.0, "judge_s": 5.0})
