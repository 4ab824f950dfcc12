"""Timing on the fake clock: a silent peer, a killed worker, a late joiner, no view or a stale one,
a close timeout. One process, the lock-step driver (``dedloc_pipeline.testing.LockStep``): every
tick each worker takes one step (one micro-batch, ``STEP_S`` seconds of the run's FakeClock),
the scheduler polls, and the clock moves; nothing sleeps, so every time below is exact and
nothing depends on the machine's load. Workers read the view every ``POLL_S`` and heartbeat every
``min(3 POLL_S, peer_timeout_s / 3)``, so the cadence's timing logic runs as in a real worker."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest
from rich.console import Console

from benchmarks import latency
from dedloc_pipeline.monitoring.display import Display
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import view
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.protocol.shard import Manifest
from dedloc_pipeline.testing import LockStep, assert_counted_once, on_clock, small_config, written

POLL_S = 1.0  # a worker's view read (a heartbeat every 3 of them at most)
STEP_S = 1.0  # one micro-batch


@pytest.fixture
def fake_run(bucket):
    def make(**kw) -> Run:
        return on_clock(init_run(bucket, small_config(**kw)))
    return make


def parts(run: Run, r: int) -> list[Manifest]:
    """Every shard of round r in the bucket, in the order they were written."""
    found = run.bucket.read_many(written(run, r)).values()
    return sorted((Manifest.model_validate_json(raw) for raw in found), key=lambda m: m.created_at)


def heartbeat(run: Run, r: int, peer: str) -> dict | None:
    return run.bucket.read_json(run.keys.progress(r, peer))


def holds(run: Run, r: int, peer: str, n: int):
    """``peer``'s heartbeat for round r, once it says it holds ``n`` samples not being uploaded."""
    def check():
        p = heartbeat(run, r, peer)
        return p if p and p["round"] == r and p["samples"] - p["sending"] >= n else None
    return check


def test_a_silent_peer_counts_until_peer_timeout_then_the_others_make_it_up(fake_run):
    """The victim holds 32 samples of round 1 and goes silent. The others upload their first parts
    counting on them, and wait while its heartbeat is younger than peer_timeout_s; once it is
    older, the scheduler stops counting it and each of them sends a second part, fewer samples
    than its own would need to fill the round: the timeout, not its own count, decided."""
    timeout = 4.0
    run = fake_run(target_batch_size=48, peer_timeout_s=timeout)
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        for peer, mb in (("a", 4), ("b", 4), ("victim", 16)):
            c.join(peer, mb)
        beat = c.until(lambda: run.latest() >= 1 and holds(run, 1, "victim", 16)(), what="the victim busy in round 1")
        c.kill("victim")
        firsts = c.until(lambda: len(parts(run, 1)) >= 2 and parts(run, 1), what="the first parts")
        assert [m.peer for m in firsts] == ["a", "b"] or [m.peer for m in firsts] == ["b", "a"]
        validated = sum(m.samples for m in firsts)
        # a view read and a step after the timeout, and a step more: a heartbeat claims its
        # peer's speed over wall time (Worker._note_speed), so each sees the other's count late
        bound = timeout + POLL_S + 2 * STEP_S
        while len(parts(run, 1)) == 2:
            assert run.clock.time() - beat["time"] < bound, "nobody made the victim's samples up"
            c.tick()
        seconds = parts(run, 1)[2:]
        assert sorted(m.peer for m in seconds) == ["a", "b"]
        for m in seconds:
            assert timeout <= m.created_at - beat["time"] <= bound, (m.created_at - beat["time"])
            assert m.samples < run.config.target_batch_size - validated  # not its own fill
        c.until(lambda: run.latest() >= 2, what="state 2")
    close = run.bucket.read_json(run.keys.close(1))
    assert close["reason"] == "target" and close["samples"] >= 48
    assert sorted(s["peer"] for s in close["accepted"]) == ["a", "a", "b", "b"]


# diloco: a worker takes an inner step every 8 samples (2 micro-batches; the victim's: every one)
ALGORITHMS = {"dedloc": {}, "diloco": {"algorithm": "diloco", "inner_batch": 8}}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.slow
def test_a_killed_worker_does_not_stop_the_run(fake_run, algorithm):
    """The victim stops (a SIGKILL: no leave, no last heartbeat) while it holds samples of the open
    round (in diloco: in the middle of its inner steps). Without delayed updates every round
    starts from empty accumulators, so its pending share really is missing from that round; the
    others make it up and the rounds keep closing without it."""
    run = fake_run(target_batch_size=48, peer_timeout_s=4.0, delayed_updates=False, **ALGORITHMS[algorithm])
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S) as c:
        for peer, mb in (("w0", 4), ("w1", 4), ("victim", 16)):
            c.join(peer, mb)
        c.until(lambda: run.latest() >= 1 and holds(run, run.latest(), "victim", 16)(), what="the victim busy")
        r_kill = run.latest()
        c.kill("victim")
        killed_at = run.clock.time()
        before = {m.peer + "/" + m.part for r in range(r_kill + 1) for m in parts(run, r) if m.peer == "victim"}
        c.until(lambda: run.latest() >= r_kill + 3, what=f"state {r_kill + 3}")
    commits = [run.commit_of(s) for s in range(1, run.latest() + 1)]
    for commit in commits:
        assert commit["samples"] >= 48 and commit["contributors"], commit
    # nothing of the victim's counts but what it had uploaded before it stopped
    assert {"victim/" + run.keys.shard_parts(s["key"])[2] for x in commits for s in x["shards"]
            if s["peer"] == "victim"} <= before
    # the round open at the kill closed from the others' samples
    open_then = commits[r_kill]
    assert open_then["round"] == r_kill and set(open_then["contributors"]) == {"w0", "w1"}, open_then
    # and every round opened after it closed from them alone
    after = [x for x in commits[r_kill + 1:] if run.commit_of(x["round"])["committed_at"] > killed_at]
    assert len(after) == 2 and all(set(x["contributors"]) == {"w0", "w1"} for x in after), after
    assert_counted_once(run)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.slow
def test_a_worker_joining_late_pulls_the_state_and_contributes(fake_run, algorithm):
    """It starts from the newest state (in diloco with a fresh inner optimizer), its shards go to
    that state's round, and the established workers go on beside it."""
    run = fake_run(**ALGORITHMS[algorithm])
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S) as c:
        c.join("w0", 4)
        c.join("w1", 4)
        c.until(lambda: run.latest() >= 2, what="state 2")
        joined_at = run.latest()
        joiner = c.join("joiner", 4)

        def counted():
            return [run.commit_of(s) for s in range(joined_at + 1, run.latest() + 1)
                    if "joiner" in run.commit_of(s)["contributors"]]
        got = c.until(counted, what="a round with the joiner among its contributors")
        assert joiner.state >= joined_at
    assert min(x["round"] for x in got) == joined_at
    for x in got:
        shards = [s for s in x["shards"] if s["peer"] == "joiner"]
        assert shards and all(run.keys.shard_parts(s["key"])[:2] == (x["round"], "joiner") for s in shards)
        assert x["samples"] >= run.config.target_batch_size
    assert all("joiner" not in run.commit_of(s)["contributors"] for s in range(1, joined_at + 1))
    assert {p for s in range(1, run.latest() + 1) for p in run.commit_of(s)["contributors"]} == {"w0", "w1", "joiner"}
    assert_counted_once(run)


def test_without_a_view_workers_hold_their_samples_and_read_latest_and_stop(fake_run):
    """No scheduler has published anything: each worker computes and uploads only a round its own
    samples fill (24 of its own, at its 6th micro-batch), then waits. A state committed without a
    view (it was never published) and the STOP marker are found by reading LATEST and STOP,
    within the fallback interval (``5 * poll_s``)."""
    run = fake_run()  # target 24, micro-batches of 4
    fallback = 5 * POLL_S
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler=False) as c:
        a, b = c.join("a", 4), c.join("b", 4)
        for _ in range(5):
            c.tick()
            assert parts(run, 0) == []  # 20 of their own each: held
        c.tick()
        assert sorted((m.peer, m.samples) for m in parts(run, 0)) == [("a", 24), ("b", 24)]
        for _ in range(3):
            c.tick()
        assert len(parts(run, 0)) == 2 and {a.snapshot().activity, b.snapshot().activity} == {"waiting"}

        with ThreadPoolExecutor(2) as pool:
            assert Scheduler(run, parallel=2, poll_s=POLL_S).step(pool)
        run.bucket.delete(run.keys.view)
        committed = run.clock.monotonic()
        c.until(lambda: a.state == b.state == 1, what="both at state 1")
        assert run.clock.monotonic() - committed <= fallback + STEP_S
        assert run.bucket.read_bytes(run.keys.view) is None

        run.bucket.write_json(run.keys.stop(), {"by": "organizer"})
        stopped = run.clock.monotonic()
        c.until(lambda: a.stopped and b.stopped, what="both stopped")
        assert run.clock.monotonic() - stopped <= fallback + STEP_S


def test_a_view_unchanged_for_peer_timeout_is_no_view(fake_run):
    """The scheduler dies right after committing state 1: its last view says round 0 closed. The
    workers, waiting at state 0, trust it until it has not changed for peer_timeout_s, then read
    LATEST themselves and move to state 1; there, without a fresh view, they hold their samples
    and each uploads only a round of its own (24 samples), however many they are."""
    timeout = 6.0
    run = fake_run(peer_timeout_s=timeout)
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        a, b = c.join("a", 4), c.join("b", 4)
        c.until(lambda: run.latest() >= 1, what="state 1")
        c.scheduler = None  # it died
        died = run.clock.monotonic()
        assert a.state == b.state == 0
        c.until(lambda: a.state == b.state == 1, what="both at state 1")
        assert timeout <= run.clock.monotonic() - died <= timeout + POLL_S + STEP_S
        assert a.snapshot().view is None and b.snapshot().view is None
        held = c.until(lambda: parts(run, 1), what="an upload to round 1")
        assert sorted((m.peer, m.samples) for m in held) == [("a", 24), ("b", 24)]



@pytest.mark.parametrize("min_fraction", [0.5, 0.75])
@pytest.mark.slow
def test_a_round_short_of_its_target_closes_at_the_close_timeout(fake_run, min_fraction):
    """The victim goes silent holding samples of round 1 after the others sent their first parts
    (24 samples, half the target) counting on it and on its projected growth; peer_timeout_s is
    long, so they wait. At
    close.timeout_s after the round opened, the scheduler closes it with what is in if that is
    at least min_fraction of the target (0.5); otherwise (0.75) it stays open until the others'
    own samples fill it."""
    close_s = 8.0
    run = fake_run(target_batch_size=48, peer_timeout_s=60.0,
                   close={"timeout_s": close_s, "min_fraction": min_fraction})
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        for peer, mb in (("a", 4), ("b", 4), ("victim", 16)):
            c.join(peer, mb)
        c.until(lambda: run.latest() >= 1 and holds(run, 1, "victim", 16)(), what="the victim busy in round 1")
        c.kill("victim")
        firsts = c.until(lambda: len(parts(run, 1)) >= 2 and parts(run, 1), what="the first parts")
        opened = run.commit_of(1)["committed_at"]
        assert run.clock.time() - opened < close_s
        validated = sum(m.samples for m in firsts)
        assert validated == 24, [(m.peer, m.samples) for m in firsts]
        c.until(lambda: run.latest() >= 2, what="state 2")
    close = run.bucket.read_json(run.keys.close(1))
    if min_fraction * 48 <= validated:
        assert close["reason"] == "timeout" and close["samples"] == validated
        assert close_s <= close["closed_at"] - opened <= close_s + STEP_S
        assert sorted(s["peer"] for s in close["accepted"]) == ["a", "b"]
    else:
        assert close["reason"] == "target" and close["samples"] >= 48
        assert close["closed_at"] - opened > close_s + STEP_S
        assert sorted(s["peer"] for s in close["accepted"]) == ["a", "a", "b", "b"]


def test_after_a_scheduler_outage_workers_are_back_to_full_speed_within_a_round(fake_run):
    """Two workers computing ahead at the cadence's own view reads (no fixed poll); as round 3
    closes the scheduler dies (state 4 committed, no view saying so) and is gone for 70 s: the
    workers find state 4 by their own reads of LATEST, then a new scheduler takes the run over.
    From the first state it commits, each worker holds every new state within a few seconds of
    its COMMIT, as before the outage (3 s here). A worker measures the reduction it waits for by
    the scheduler's clock (CLOSE to COMMIT); measured by when it noticed the state (its own view
    reads), its lateness stretched its next waits, and it noticed states 5 to 8 13, 6, 4 and 3 s
    late: the crawl after a restart."""
    run = fake_run(target_batch_size=16, delayed_updates=True)
    seen: dict[tuple[str, int], float] = {}  # (peer, state) -> when it held it (the run's clock)
    with LockStep(run, poll_s=None, step_s=1.0, scheduler_every=1, delayed=True) as c:
        for peer in ("a", "b"):
            c.join(peer, 4)

        def watching(done):
            def check():
                for p, w in c.workers.items():
                    seen.setdefault((p, w.state), run.clock.time())
                return done()
            return check
        c.until(watching(lambda: run.bucket.exists(run.keys.close(3))), what="round 3 closed")
        c.scheduler = None  # the outage
        for _ in range(70):
            c.tick()
            watching(lambda: None)()
        c.scheduler = Scheduler(run, parallel=2)
        c.until(watching(lambda: all(w.state >= 8 for w in c.workers.values())), what="state 8 everywhere")

    def lag(s: int) -> float:
        return max(seen[(p, s)] for p in ("a", "b")) - run.commit_of(s)["committed_at"]
    before = max(lag(s) for s in (2, 3))
    assert lag(4) > 10 * before  # the outage's own
    assert all(lag(s) <= max(3.0, 2 * before) for s in (5, 6, 7, 8)), [lag(s) for s in range(2, 9)]


def test_the_latency_budget_adds_up_to_what_the_records_and_heartbeats_say(fake_run):
    """``make bench``'s latency budget (benchmarks/latency.py) on the fake clock: each stage is
    read from the bucket (CLOSE, COMMIT and its stages, the manifests' landing, the workers'
    heartbeats), and for each worker the stages add up to the time from the target reached to
    the state held; the organizer's stages are COMMIT's own."""
    run = fake_run(target_batch_size=16, delayed_updates=True)
    recorder = latency.Recorder(run.bucket, run.keys, ["a", "b"])
    with LockStep(run, poll_s=None, step_s=1.0, scheduler_every=1, delayed=True) as c:
        for peer in ("a", "b"):
            c.join(peer, 4)

        def observed() -> bool:  # as the benchmark does, while the collaboration runs
            recorder.observe()
            return all((p, 6) in recorder.held for p in ("a", "b"))
        c.until(observed, what="state 6 held, as heartbeats say")
    budget = recorder.budget(run, 2, 5)
    assert [row["round"] for row in budget["rounds"]] == [2, 3, 4, 5]
    for row in budget["rounds"]:
        commit = run.commit_of(row["round"] + 1)
        assert all(row[s] == commit["stages"][f"{s}_s"] for s in ("settle", "reduce", "apply", "judge"))
        assert row["samples"] == commit["samples"] and len(row["download"]) == len(row["poll"]) == 2
        organizer = sum(row[s] for s in latency.ORGANIZER)
        for poll, download, total in zip(row["poll"], row["download"], row["total"]):
            assert min(poll, download, row["close"], row["publish"]) >= 0
            assert total >= organizer + poll + download - 1e-6  # the view named it to each at once, or later
        assert min(row["total"]) == pytest.approx(organizer + min(row["poll"]) + row["download"][
            row["poll"].index(min(row["poll"]))])
    assert budget["stages"]["total"]["worst"] == max(t for row in budget["rounds"] for t in row["total"])


def test_a_joining_peer_is_on_the_others_panels_at_their_next_view_read(fake_run):
    """The report: a joining peer stayed invisible on the others' panels for about 20 s. Far from
    the target a worker reads the round view seldom (a share of the ETA, at most ``poll_max_s``:
    what its reads cost), so it sees a joiner at its first read after the scheduler's view counts
    it, and its panel says how old its picture of the others is."""
    run = fake_run(target_batch_size=256)  # 32 s rounds at two peers' 8 samples a second
    with LockStep(run, step_s=STEP_S, scheduler_every=1) as c:
        c.poll_s = None  # the run's own cadence from here on: workers joined now read as users' do
        w0 = c.join("w0", 4)
        c.join("w1", 4)
        c.until(lambda: run.latest() >= 3, what="state 3")
        shown = Display(w0, plain=True, console=Console(file=io.StringIO()))
        c.join("joiner", 4)
        counted_at = None
        for _ in range(60):
            c.tick()
            now, published = run.clock.monotonic(), view.read(run.bucket, run.keys)
            if counted_at is None and published.peers + published.ahead_peers == 3:
                counted_at = now
            f = shown.facts()
            if w0.follower.view is not None:  # the view in hand, and how old it is
                assert f"{f['peers']} peers, as of {now - w0.follower.read_at:.0f} s ago)" in shown.line(f)
            if counted_at is not None and w0.follower.read_at >= counted_at:  # its first read since
                assert f["peers"] == 2, shown.line(f)
                break
        else:
            raise AssertionError("the joiner was not counted, or w0 did not read the view again")
    assert now - counted_at <= run.config.cadence.poll_max_s
