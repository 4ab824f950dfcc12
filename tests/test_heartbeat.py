"""Heartbeats as projections (protocol/heartbeat.py): a worker writes one only when readers'
projection of its last would go wrong, a landed manifest takes its samples out of the count
without one, and a heartbeat of a peer in long rounds stands as long as it said."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import heartbeat, view
from dedloc_pipeline.protocol.heartbeat import Heartbeat
from dedloc_pipeline.testing import assert_counted_once, on_clock
from dedloc_pipeline.volunteer.worker import Worker

from .test_protocol import put_shard


def _beat(samples=40, speed=4.0, next_s=20.0, time=100.0, landed=0, r=0) -> Heartbeat:
    return Heartbeat(peer="a", round=r, samples=samples, sending=0, samples_per_s=speed, next_s=next_s, time=time,
                     landed=landed)


def test_a_heartbeat_is_due_only_when_its_projection_would_go_wrong():
    """Step 4 samples, target 1000 (so the low side's margin is 20 samples, a fiftieth)."""
    last = _beat()  # 40 samples at t=100, growing 4/s for 20 s

    def due(pending, at, landed=0, r=0):
        return heartbeat.due(last, r, pending, landed, at, 1000, 4)

    assert heartbeat.due(None, 0, 0, 0, 100.0, 1000, 4)  # the first one
    assert due(40, 101.0, r=1)  # another round
    assert due(120, 120.0)  # its keep-alive: next_s passed
    assert not due(40 + 40, 110.0)  # on its projection
    assert not due(40 + 40 - 8, 110.0)  # two steps below it: the projection leads between steps
    assert due(40 + 40 - 9, 110.0)  # further: the others would upload early, so it says so
    assert not due(40 + 40 + 20, 110.0) and due(40 + 40 + 21, 110.0)  # above: a fiftieth of the target
    assert not due(40 + 40 - 30, 110.0, landed=30)  # a shard of 30 landed: its manifest counts them


def test_a_heartbeat_stands_for_its_interval_plus_two_thirds_of_the_timeout():
    timeout, bound = 30.0, 60.0
    for next_s, lives in ((5.0, 30.0), (10.0, 30.0), (50.0, 70.0), (1e9, 80.0), (None, 30.0)):
        beat = _beat(next_s=next_s)
        assert heartbeat.lifetime(beat, timeout, bound) == lives
        assert heartbeat.counted(beat, 0, 100.0 + lives - 0.01, timeout, 1000, bound) is not None
        assert heartbeat.counted(beat, 0, 100.0 + lives, timeout, 1000, bound) is None


def test_the_scheduler_takes_a_landed_shards_samples_out_of_its_peers_heartbeat(make_run):
    """a's heartbeat says 12 pending (its shard on the way), 0 landed; its manifest of 12 lands:
    the view counts them as validated and no longer as pending, with no new heartbeat. Its next
    heartbeat (8 more computed, the 12 counted as landed) counts 8; b's shard is no concern of a's."""
    run = on_clock(make_run())
    now = run.clock.time()

    def beat(peer, samples, landed):
        heartbeat.write(run.bucket, run.keys, Heartbeat(peer=peer, round=0, samples=samples, sending=0,
                                                        samples_per_s=0.0, next_s=10.0, time=now, landed=landed))

    def published() -> view.View:
        Scheduler(run, 1, 0).try_close(0)
        return view.parse(run.bucket.read_bytes(run.keys.view))

    beat("a", 12, 0)
    beat("b", 4, 0)
    assert published().pending_samples == 16
    put_shard(run, 0, "a", samples=12)
    v = published()
    assert (v.validated_samples, v.pending_samples) == (12, 4)
    beat("a", 8, 12)
    assert published().pending_samples == 12
    beat("a", 8, 99)  # a claim of more landed than its manifests hold takes nothing out
    assert published().pending_samples == 12


def test_workers_in_long_rounds_heartbeat_about_twice_a_round(make_run, monkeypatch):
    """Two workers on the fake clock at their own adaptive cadence (no fixed poll), 4 samples a
    second each, rounds of 200 samples (about 26 s): once a round has passed they know its
    length and write a heartbeat as they start a round and one keep-alive 0.6 of a round later
    (the old rule wrote one every 5 to 10 s and two per upload: six or more). The rounds still close on the target and
    every sample counts once."""
    run = on_clock(make_run(target_batch_size=200))
    written = Counter()
    write = heartbeat.write
    monkeypatch.setattr(heartbeat, "write", lambda b, k, beat: (written.update([(beat.peer, beat.round)]),
                                                                 write(b, k, beat)))
    workers = [Worker(run, p, micro_batch=4, threads=1) for p in ("a", "b")]
    sched = Scheduler(run, 1)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(400):
            if run.latest() >= 5:
                break
            for w in workers:
                w.step()
                w.flush()
            sched.step(pool)
            run.clock.sleep(1.0)
        for w in workers:
            w.leave()
    assert run.latest() >= 5
    for r in (2, 3):
        close = run.bucket.read_json(run.keys.close(r))
        assert close["reason"] == "target" and close["samples"] >= 200
        for p in ("a", "b"):
            assert written[(p, r)] == 2, dict(written)
    assert_counted_once(run)
    last = workers[0]._beats[-1]
    assert heartbeat.parse(run.bucket.read_bytes(run.keys.progress(last.round, "a"))) == last
    assert last.left and 14 <= last.next_s <= 17  # 0.6 of a round of about 26 s
