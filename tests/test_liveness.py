"""Liveness on the fake clock: while the volunteers who are live can fill the target, rounds close,
whoever left. Volunteers come and go (everyone leaves and one returns, one joins a run nobody
else is in, volunteers arrive one by one); the influence cap counts only those present; a
volunteer that computed ahead for a round that turned out short sends those samples after all;
and workers stop computing for a round a finished scheduler will not aggregate. Lock-step driver
(``dedloc_pipeline.testing.LockStep``): nothing sleeps, every time is exact."""

from __future__ import annotations

import pytest

from dedloc_pipeline.monitoring.display import Display
from dedloc_pipeline.monitoring.status import scheduler_line, status
from dedloc_pipeline.organizer import lease
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run, RunError, init_run
from dedloc_pipeline.testing import LockStep, assert_counted_once, on_clock, small_config, written
from dedloc_pipeline.volunteer.worker import Worker

POLL_S = 1.0
STEP_S = 1.0
TIMEOUT = 6.0  # peer_timeout_s: also how long a previous state's contributors count as present


@pytest.fixture
def fake_run(bucket):
    def make(**kw) -> Run:
        kw = dict(dict(target_batch_size=24, peer_timeout_s=TIMEOUT, delayed_updates=True), **kw)
        return on_clock(init_run(bucket, small_config(**kw)))
    return make


def counted(run: Run, r: int) -> dict[str, int]:
    """Each volunteer's counted samples in round r's CLOSE."""
    out: dict[str, int] = {}
    for s in run.bucket.read_json(run.keys.close(r))["accepted"]:
        out[s["peer"]] = out.get(s["peer"], 0) + round(s["weight"])
    return out


def leave(c: LockStep, *peers: str) -> None:
    """Ctrl-C: each finishes its uploads and says its pending samples will not come."""
    for p in peers:
        c.workers.pop(p).leave()


def test_everyone_leaves_and_one_returns_alone(fake_run):
    """alice, bob and carol train three states and leave. Long after, carol returns alone: her
    round is hers to fill, capped by nobody who is gone (the first report: 43 of 64 counted, the
    run stalled for good)."""
    run = fake_run()
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        for p in ("alice", "bob", "carol"):
            c.join(p, 4)
        c.until(lambda: run.latest() >= 3, what="state 3")
        leave(c, "alice", "bob", "carol")
        for _ in range(int(3 * TIMEOUT)):
            c.tick()  # nobody computes: the scheduler polls an empty round
        back = run.latest()
        c.join("carol", 4)
        c.until(lambda: run.latest() >= back + 3, max_ticks=60, what=f"state {back + 3} from carol alone")
    for r in range(back, back + 3):
        got = counted(run, r)
        assert set(got) == {"carol"} and got["carol"] >= 24, (r, got)
    assert_counted_once(run)
    # the idle time before carol returned is not the round's: its time runs from her first work
    c = run.commit_of(back + 1)
    assert c["committed_at"] - c["opened_at"] >= 3 * TIMEOUT
    (h,) = [h for h in status(run)["history"] if h["round"] == back]
    assert h["duration_s"] == c["committed_at"] - c["started_at"] <= 10 * STEP_S


def test_a_volunteer_joining_right_after_the_others_left_fills_the_round_once_they_are_gone(fake_run):
    """The interleaving the first report depended on: alice and bob contributed to state s and
    left; carol joins at once. For peer_timeout_s after the round opened the previous state's
    contributors count as present (so a liar cannot fill a round before the honest peers'
    heartbeats arrive): her shard counts 16 of its 24 (2/V, V = 3), and the view says her share is
    capped, so she sends no further part and computes ahead, at most a round of it. Once they count
    as gone her shard fills the round, and what she computed ahead counts in the next one: none of
    her samples was computed for nothing."""
    grace = 20.0
    run = fake_run(peer_timeout_s=grace)
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        for p in ("alice", "bob"):
            c.join(p, 4)
        c.until(lambda: run.latest() >= 2, what="state 2")
        leave(c, "alice", "bob")
        s = run.latest()
        opened = run.commit_of(s)["committed_at"]
        carol = c.join("carol", 4)
        c.until(lambda: carol.snapshot().view is not None and carol.snapshot().view.capped, what="carol capped")
        view = run.bucket.read_json(run.keys.view)
        assert (view["validated_samples"], view["cap"]) == (16, 16) and run.clock.time() - opened < grace
        c.until(lambda: run.latest() > s, max_ticks=int(2 * grace), what=f"state {s + 1}")
        assert [n for r, _, n in carol.uploads if r == s] == [24]  # no further part while capped
        close = run.bucket.read_json(run.keys.close(s))
        assert grace <= close["closed_at"] - opened <= grace + 2 * STEP_S, close["closed_at"] - opened
        assert counted(run, s) == {"carol": 24} == {"carol": close["samples"]}
        c.until(lambda: run.latest() >= s + 2, max_ticks=int(2 * grace), what=f"state {s + 2}")
    assert counted(run, s + 1)["carol"] >= 24
    assert carol.computed_samples == carol.uploaded_samples + (carol.acc.samples if carol.acc else 0)
    assert_counted_once(run)


def test_volunteers_arriving_one_by_one_close_every_round(fake_run):
    """One volunteer, then a second, then a third: rounds close all along, and each newcomer's
    samples count from the round it joined."""
    run = fake_run()
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        joined = {}
        for p in ("a", "b", "c"):
            joined[p] = run.latest()
            c.join(p, 4)
            c.until(lambda: run.latest() >= joined[p] + 2, max_ticks=60, what=f"two states after {p} joined")
    for p, at in joined.items():
        assert any(p in run.commit_of(s)["contributors"] for s in range(at + 1, run.latest() + 1)), p
    assert_counted_once(run)


def test_workers_stop_computing_for_a_round_an_ended_scheduler_will_not_aggregate(fake_run):
    """The scheduler reaches its last round (``--until-round``) and says so in the view: the
    workers stop computing and upload nothing to the round nobody will close (the first report:
    72 samples each, 30 s later). A scheduler started again continues the run, and them with it."""
    run = fake_run()
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        a, b = c.join("a", 4), c.join("b", 4)
        c.until(lambda: run.latest() >= 2, what="state 2")
        sched, c.scheduler = c.scheduler, None
        assert sched.serve(until_round=2) == 2  # reached: it ends at once, saying why
        view = run.bucket.read_json(run.keys.view)
        assert view["state"] == 2 and "--until-round" in view["ended"]
        c.until(lambda: a.state == b.state == 2, what="both at state 2")
        computed = a.computed_samples + b.computed_samples
        for _ in range(int(3 * TIMEOUT)):  # the view goes stale; what it says holds
            c.tick()
        assert {a.activity, b.activity} == {"waiting"}
        note = "no scheduler: the scheduler reached its last round (--until-round)"
        assert a.snapshot().scheduler == note and Display(a).facts()["activity"] == f"{note}: waiting"
        assert a.computed_samples + b.computed_samples <= computed + 2 * 4
        assert written(run, 2) == []
        c.scheduler = sched
        c.until(lambda: run.latest() >= 4, max_ticks=60, what="state 4 after the scheduler is back")
    assert_counted_once(run)


def test_a_scheduler_interrupted_says_so_in_the_view(fake_run):
    """Ctrl-C (or SIGTERM, taken as it) while the scheduler waits for a round: the view says it
    exited, so workers stop computing for a round nobody will close."""
    run = fake_run()

    class Interrupting(type(run.clock)):
        def sleep(self, seconds):
            raise KeyboardInterrupt

    sched = Scheduler(run, poll_s=POLL_S, clock=Interrupting(epoch=run.clock.time()))
    with pytest.raises(KeyboardInterrupt):
        sched.serve()
    view = run.bucket.read_json(run.keys.view)
    assert view["state"] == 0 and view["ended"] == "the scheduler was stopped (Ctrl-C, or SIGTERM)"
    assert scheduler_line(status(run)).startswith("no scheduler: the scheduler was stopped (Ctrl-C, or SIGTERM)")


def test_status_says_what_closes_rounds_and_how_to_go_on(fake_run):
    """`dedloc status` names the scheduler's state: publishing, silent for how long (and since
    when), ended and why, or the run stopped; each with what to do (the first report: a run
    stopped, or without its scheduler for 9 minutes, looked like any other)."""
    run = fake_run()
    assert scheduler_line(status(run)).startswith("no scheduler has published yet")
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        c.join("a", 4)
        c.until(lambda: run.latest() >= 1, what="state 1")
        line = scheduler_line(status(run))
        assert line.split(";")[0] in {f"scheduler: published {n} s ago" for n in ("0.0", "1.0")}
        assert f"; the lease is {lease.this_holder()} (since " in line and "unless renewed)" in line, line
        sched, c.scheduler = c.scheduler, None  # it died
        for _ in range(int(2 * TIMEOUT)):
            c.tick()
        line = scheduler_line(status(run))
        assert line.startswith("no scheduler has published for 1") and "(since " in line, line
        shown = Display(c.workers["a"])
        facts = shown.facts()
        assert facts["activity"].startswith("no scheduler has published for ") and \
            "holding its samples" in facts["activity"]
        assert ") no scheduler | you:" in shown.line(facts)  # the round's bar: no ETA, no "full: reducing"
        assert line.endswith("start one (dedloc aggregate, or make pretrain)")
        sched.serve(until_round=run.latest())
        assert scheduler_line(status(run)).startswith("no scheduler: the scheduler reached its last round")
        run.bucket.write_json(run.keys.stop(), {"by": "organizer"})
        assert scheduler_line(status(run)).startswith(f"stopped: STOP.json is in the run; to continue, delete "
                                                      f"runs/{run.name}/STOP.json")


def test_a_second_worker_with_a_live_peer_id_is_refused(fake_run):
    """Two machines started with one peer id would share its data stream, and one twin's shards
    would be rejected every round: the second is refused at start, naming why. An id whose
    worker left (its last heartbeat says so) is free at once; one killed, after peer_timeout_s."""
    run = fake_run()
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler_every=1) as c:
        c.join("a", 4)
        c.join("b", 4)
        for _ in range(3):
            c.tick()
        with pytest.raises(RunError, match="peer id 'a' is live on another machine .* another --peer-id"):
            Worker(run, "a", micro_batch=4, threads=1, poll_s=POLL_S)
        leave(c, "a")
        Worker(run, "a", micro_batch=4, threads=1, poll_s=POLL_S)  # left: free at once
        c.kill("b")
        with pytest.raises(RunError, match="peer id 'b' is live"):
            Worker(run, "b", micro_batch=4, threads=1, poll_s=POLL_S)
        run.clock.advance(TIMEOUT)
        Worker(run, "b", micro_batch=4, threads=1, poll_s=POLL_S)  # killed: gone after peer_timeout_s


def test_a_worker_that_leaves_while_computing_ahead_frees_its_id_at_once(fake_run):
    """Its heartbeats were for the next round (the open one full, waiting for its reduction):
    its last one says it left there too. (The soak with faults found the id refused on its
    return: the left heartbeat went to the open round only, the next round's stayed live.)"""
    run = fake_run()
    with LockStep(run, poll_s=POLL_S, step_s=STEP_S, scheduler=False) as c:
        c.join("a", 4)
        c.join("b", 4)
        c.until(lambda: run.bucket.exists(run.keys.progress(run.latest() + 1, "a")), what="a heartbeating ahead")
        leave(c, "a")
        Worker(run, "a", micro_batch=4, threads=1, poll_s=POLL_S)
