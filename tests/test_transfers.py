"""Transfers off the compute path (volunteer/worker.py): a shard uploads and a new state downloads
on the worker's transfer thread while it keeps computing; nothing is counted twice or lost, and
a shard is whole or absent."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dedloc_pipeline.checks import catalog
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import heartbeat, shard
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.testing import written
from dedloc_pipeline.volunteer import upload_policy
from dedloc_pipeline.volunteer.worker import Worker

from .test_protocol import finish, put_shard


def _gated_upload(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """shard.upload held before its chunks until ``release`` is set; ``started`` says it began."""
    started, release, upload = threading.Event(), threading.Event(), shard.upload

    def held(*a, **kw):
        started.set()
        assert release.wait(30)
        return upload(*a, **kw)

    monkeypatch.setattr(shard, "upload", held)
    return started, release


def test_a_worker_computes_while_its_shard_uploads(make_run, monkeypatch):
    """Alone in a round of 24 (micro-batch 4, no delayed updates) a worker uploads after 6
    micro-batches. While that upload is held it computes on (delayed updates: toward the next
    round), its heartbeat for round 0 still counts the shard's samples as pending, and no
    manifest exists; released, the shard lands whole and is counted once: the manifest, not a
    heartbeat, takes the samples out of round 0's pending count (``heartbeat.counted``, its
    ``landed`` as listed)."""
    run = make_run(delayed_updates=True)
    started, release = _gated_upload(monkeypatch)
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0)
    while not started.is_set():
        w.step()
    assert w.uploads == [] and written(run, 0) == []
    computed = w.computed_samples
    for _ in range(3):
        assert w.step()  # computing, the upload still held
    assert w.computed_samples == computed + 12 and w.acc.round == 1
    own = upload_policy.without_view(0, w.transfers.sent, 0.0)
    assert own.manifest_samples == 24  # its own count has the shard on the way ...
    beat = heartbeat.parse(run.bucket.read_bytes(run.keys.progress(0, "a")))  # ... and so do the others'
    cfg, now = run.config, run.clock.time()
    count = lambda landed: heartbeat.counted(beat, 0, now, cfg.peer_timeout_s, 24, 0.0, landed).samples  # noqa: E731
    assert beat.samples == count(0) == 24 and beat.landed == 0
    release.set()
    w.flush()
    (manifest,) = written(run, 0)
    entry = catalog.validate(run, 0, run.keys.shard_of(manifest), run.bucket.read_bytes(manifest))
    assert entry.samples == 24 and w.uploads[0][2] == 24 and w.uploaded_samples == 24
    assert count(24) == 0  # landed: the manifest's 24 samples leave the heartbeat's count


def test_a_new_state_downloads_while_the_worker_computes(make_run, monkeypatch):
    """The round view names state 1: the worker starts its download and computes its next
    micro-batch on state 0 meanwhile (one step stale, counted toward round 1); the state is
    installed between micro-batches, bit for bit the committed one."""
    run = make_run(delayed_updates=True)
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0)
    w.sync()
    put_shard(run, 0, "other", samples=24)
    assert Scheduler(run, 1, 0).try_close(0) is not None
    finish(run, 0)
    Scheduler(run, 1, 0).try_close(1)  # the view now names state 1
    gate, load = threading.Event(), w.follower.load

    def held(*a):
        assert gate.wait(30)
        return load(*a)

    monkeypatch.setattr(w.follower, "load", held)
    assert w.step() and w.state == 0 and w.transfers.fetching is not None
    assert w.acc.round == 1 and w.acc.stale_samples == 4  # computed on state 0, toward round 1
    gate.set()
    w.flush()
    assert w.state == 1 and (w.flat.get() == run.load_params(1)).all()


def test_leaving_waits_for_the_upload_under_way(make_run, monkeypatch):
    """leave() (Ctrl-C once, or the end of serve) lets the shard under way land, then withdraws
    the pending samples; the transfer thread is gone after it."""
    run = make_run()
    started, release = _gated_upload(monkeypatch)
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0)
    while not started.is_set():
        w.step()
    with ThreadPoolExecutor(1) as pool:
        left = pool.submit(w.leave)
        assert not left.done()
        release.set()
        left.result(30)
    assert len(written(run, 0)) == 1 and w.uploaded_samples == 24
    assert run.bucket.read_json(run.keys.progress(0, "a"))["samples"] == 0
    assert not any(t.name.startswith("a-transfers") for t in threading.enumerate())


def test_a_second_part_waits_for_the_others_uploads_to_land(make_run):
    """Round 0 of 24: b heartbeats 12 pending (its shard on the way), a uploads its first 12.
    With b's shard not in yet a's next 12 samples alone would fill the round, but a second part
    goes only once that has held for twice a's own upload time (b's shard lands meanwhile, as a
    real one would); in lock-step (poll_s 0) it goes at once."""
    run = make_run()
    sched = Scheduler(run, 1, 0)
    run.bucket.write_json(run.keys.progress(0, "b"), {"peer": "b", "round": 0, "samples": 12,
                                                      "samples_per_s": 0.0, "next_s": 0.0, "time": time.time()})
    sched.try_close(0)
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0.01)
    while 0 not in w.parts.uploaded:
        w.step()
    w.flush()
    assert [n for _, _, n in w.uploads] == [12]
    sched.try_close(0)  # 12 validated, b's 12 still pending
    w.transfers.upload_s = 3600.0  # as if a's upload had taken an hour: b's is surely still under way
    for _ in range(6):
        w.step()
        w.flush()
    assert len(w.uploads) == 1 and w.acc.samples >= 12  # needed by the count, held back
    w.transfers.upload_s = 0.0
    w.step()
    w.flush()
    assert len(w.uploads) == 2

    lockstep = Worker(run, "c", micro_batch=4, threads=1, poll_s=0)
    lockstep.parts.uploaded.add(0)  # as if its first part were in: the second is not held
    lockstep.transfers.upload_s = 3600.0
    assert lockstep.parts.still_short(0, lockstep.transfers.upload_s)


def test_a_second_part_goes_on_a_view_read_then_never_into_a_closed_round(make_run, monkeypatch):
    """On moto's S3 at target 64, 17% of honest samples were lost: a volunteer sent a second part
    on a view read before the others' part filled the round and CLOSE was written, and it
    arrived after CLOSE. A second part now goes on a view read just then: here round 0 closed
    meanwhile, so a's samples are carried to round 1 (one step stale) instead. The control, on the
    view in hand, sends them late."""
    def race(still_wanted: bool | None):
        run = make_run(run=f"race-{still_wanted}", delayed_updates=True)
        sched = Scheduler(run, 1, 0)
        run.bucket.write_json(run.keys.progress(0, "b"), {"peer": "b", "round": 0, "samples": 12,
                                                          "samples_per_s": 0.0, "next_s": 0.0, "time": time.time()})
        sched.try_close(0)
        w = Worker(run, "a", micro_batch=4, threads=1, poll_s=3600.0)  # reads the view only when made to
        if still_wanted is not None:
            monkeypatch.setattr(w, "_still_wanted", lambda acc: still_wanted)
        while 0 not in w.parts.uploaded:
            w.step()
        w.flush()
        w.step()  # reads the view after its part landed: 12 in, b's 12 pending
        put_shard(run, 0, "b", samples=12)
        assert sched.try_close(0) is not None  # b's part filled it: closed, the closed view published
        w.transfers.upload_s = 0.0  # a second part is not held back for the others' uploads
        while w.acc is None or w.acc.samples < 12:  # a's 12 alone would fill what the view in hand lacks
            w.step()
            w.flush()
        w.step()
        w.flush()
        return run, w

    run, w = race(None)
    assert [r for r, _, _ in w.uploads] == [0] and w.acc.round == 1 and w.acc.stale_samples >= 12
    run, w = race(True)  # the control: sent on the view in hand
    assert [r for r, _, _ in w.uploads] == [0, 0]
    assert w.uploads[1][1] not in {e.key for e in Close.read(run, 0).accepted}  # after CLOSE: lost
