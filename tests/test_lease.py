"""One active scheduler per run (organizer/lease.py): a second one is refused naming the first,
or waits; a released lease is free at once, a dead one's after its time; a scheduler whose
lease was taken over stops, and an idle poll costs no lease request. On the fake clock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

import dedloc_pipeline.organizer.lease as lease_module
from dedloc_pipeline.organizer.lease import LEASE_S, RENEW, Lease, LeaseHeld, LeaseLost, Record, holder_of
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import on_clock

from .conftest import small_config


def _scheduler(run: Run, holder: str) -> Scheduler:
    return Scheduler(run, 1, 0, holder=holder)


def test_a_second_scheduler_is_refused_naming_the_first_until_it_releases(make_run):
    run = on_clock(make_run())
    a, b = _scheduler(run, "organizer-laptop"), _scheduler(run, "cloud-vm")
    a.poll()
    with pytest.raises(LeaseHeld, match="scheduled by organizer-laptop .*--standby"):
        b.poll()
    assert "organizer-laptop" in holder_of(run.bucket, run.keys, run.clock.time())
    a.end(0, "rounds")  # a clean exit releases it: b need not wait
    assert holder_of(run.bucket, run.keys, run.clock.time()) is None
    b.poll()
    assert b.lease.generation == 1
    assert "cloud-vm" in holder_of(run.bucket, run.keys, run.clock.time())


def test_a_dead_schedulers_lease_frees_after_its_time_and_a_paused_one_stops(make_run):
    """a is killed (or paused): b is refused while a's lease is within its time, takes it over
    after, and a, resuming, finds it taken at its next renewal and stops, naming b."""
    run = on_clock(make_run())
    a, b = _scheduler(run, "a"), _scheduler(run, "b")
    a.poll()
    run.clock.advance(LEASE_S - 1)
    with pytest.raises(LeaseHeld, match="free in 1.0 s unless renewed"):
        b.poll()
    run.clock.advance(2)
    b.poll()
    with pytest.raises(LeaseLost, match="taken over by b"):
        a.poll()
    a.end(0, "rounds")  # says nothing: the view is b's now
    assert "b" == holder_of(run.bucket, run.keys, run.clock.time()).split(" ")[0]


def test_a_lease_is_renewed_every_half_of_its_time_and_an_idle_poll_costs_nothing(make_run):
    run = on_clock(make_run())
    lease = Lease(run.bucket, run.keys, run.clock, "a")
    lease.hold()
    before = Counter(run.bucket.stats.requests)
    run.clock.advance(LEASE_S * RENEW - 1)
    lease.hold()
    assert Counter(run.bucket.stats.requests) == before
    run.clock.advance(1)
    lease.hold()  # the next generation's absence (HEAD), then its own record rewritten (PUT)
    assert Counter(run.bucket.stats.requests) - before == Counter(head=1, put=1)
    run.clock.advance(LEASE_S - 1)  # renewed: still held, though a minute has passed since it was taken
    with pytest.raises(LeaseHeld):
        Lease(run.bucket, run.keys, run.clock, "b").hold()


def test_a_standby_scheduler_waits_for_the_lease_and_then_serves(make_run):
    run = on_clock(make_run())
    _scheduler(run, "a").poll()  # then killed: never renewed, never released
    standby = _scheduler(run, "b")
    standby.lease.wait()  # the fake clock's sleep moves time: it returns once a's lease expired
    assert standby.lease.generation == 1
    assert run.clock.monotonic() > LEASE_S


@pytest.mark.parametrize("standby", [False, True])
def test_a_scheduler_stopped_before_its_first_poll_releases_the_lease(make_run, monkeypatch, standby):
    """SIGTERM (KeyboardInterrupt) can land between taking the lease and the first poll: the
    lease is still released at once (found by the real-process case below, where the standby was
    stopped just after taking over). Control: a held lease is seen as held."""
    run = make_run()
    sched = Scheduler(run, 1, 0)

    def interrupted():
        sched.lease.hold()
        assert not lease_module.newest(run.bucket, run.keys)[1].released  # the control: held
        raise KeyboardInterrupt
    monkeypatch.setattr(sched, "poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sched.serve(standby=standby)
    assert lease_module.newest(run.bucket, run.keys)[1].released


def test_the_same_holder_continues_its_lease_and_a_dead_process_here_frees_it_at_once(make_run):
    """Schedulers of one process (the Prefect flow makes one per task) share their lease; the
    lease of a process of this host that no longer exists is free without waiting."""
    run = on_clock(make_run())
    _scheduler(run, "a").poll()
    _scheduler(run, "a").poll()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    g = Lease(run.bucket, run.keys, run.clock, "x")
    now = run.clock.time()
    run.bucket.write_json(run.keys.lease(0), Record(holder=f"{socket.gethostname()}:{pid}", host=socket.gethostname(),
                                                    pid=pid, started_at=now, renewed_at=now,
                                                    ttl_s=LEASE_S).model_dump())
    g.hold()
    assert g.generation == 1


def test_a_damaged_lease_is_taken_as_free_naming_it(make_run, caplog):
    run = on_clock(make_run())
    run.bucket.write_bytes(run.keys.lease(0), b'{"holder": "a", "ho')
    lease = Lease(run.bucket, run.keys, run.clock, "b")
    lease.hold()
    assert lease.generation == 1
    assert run.keys.lease(0) in caplog.text and "taken as free" in caplog.text


def test_two_schedulers_racing_for_a_free_lease_one_wins(make_run, monkeypatch):
    """Both read the released generation 0 as free; creating generation 1 is create-once, so
    the later one is refused, naming the winner."""
    run = on_clock(make_run())
    a = Lease(run.bucket, run.keys, run.clock, "a")
    a.hold()
    a.release()
    Lease(run.bucket, run.keys, run.clock, "c").hold()
    real = lease_module.newest
    stale = [(0, Record.model_validate(run.bucket.read_json(run.keys.lease(0))))]  # what b read before c won
    monkeypatch.setattr(lease_module, "newest", lambda bucket, keys: stale.pop() if stale else real(bucket, keys))
    with pytest.raises(LeaseHeld, match="took the lease first, c "):
        Lease(run.bucket, run.keys, run.clock, "b").hold()


def _wait_for(what, predicate, procs, seconds: float = 60.0):
    """Until ``predicate()`` (a real process's doing), or fail naming ``what`` with their output."""
    deadline = time.monotonic() + seconds
    while not predicate():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"{what}: " + " | ".join(str(p.communicate()[0]) for p in dead))
        time.sleep(0.1)  # a real process's progress: nothing to drive


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_real_schedulers_one_refused_one_standing_by(tmp_path):
    """Three `dedloc aggregate` processes on one run: the first holds the lease; the second is
    refused at once with one line naming the first (host:pid); the third (--standby) waits, and
    takes over when the first is stopped with SIGTERM, which releases the lease at once."""
    url = f"file://{tmp_path}/b"
    run = init_run(Bucket(url), small_config("r"))
    cmd = [os.path.join(os.path.dirname(sys.executable), "dedloc"), "aggregate", "--bucket", url, "--run", "r",
           "--poll", "0.2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def start(*extra, out=subprocess.PIPE):
        return subprocess.Popen([*cmd, *extra], env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def holder():
        _, record = lease_module.newest(run.bucket, run.keys)
        return None if record is None or record.released else record.holder

    first = start()
    procs = [first]
    try:
        _wait_for("the first scheduler takes the lease", lambda: holder() is not None, procs)
        assert holder() == f"{socket.gethostname()}:{first.pid}"
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = tmp_path / "standby.log"
        with open(log, "w") as out:  # started beside the second: each takes seconds to import
            standby = start("--standby", out=out)
        procs += [second, standby]
        _, err = second.communicate(timeout=120)
        procs.remove(second)
        assert second.returncode == 2, err
        refusal = [x for x in err.splitlines() if x.startswith("error:")]
        assert refusal and f"is scheduled by {socket.gethostname()}:{first.pid} (since" in refusal[0], err
        _wait_for("the standby says it waits", lambda: "waiting (standby)" in log.read_text(), procs)
        assert "with --standby" not in log.read_text()  # the refusal's advice is not the standby's
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=60)
        assert first.returncode == 143, out
        procs.remove(first)
        _wait_for("the standby takes over", lambda: holder() == f"{socket.gethostname()}:{standby.pid}", procs)
        assert lease_module.newest(run.bucket, run.keys)[0] == 1
        standby.send_signal(signal.SIGTERM)
        standby.wait(timeout=60)
        assert standby.returncode == 143, log.read_text()
        assert holder() is None  # released on its way out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
