"""The round view (protocol/view.py): what the scheduler publishes each poll is what it validated;
claims nobody validated cannot stall a round; without a fresh view workers compute and hold; a
volunteer's poll costs the same whatever the number of peers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import heartbeat, view
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import RunLayout
from dedloc_pipeline.testing import assert_counted_once, on_clock, written
from dedloc_pipeline.volunteer import upload_policy
from dedloc_pipeline.volunteer.worker import Worker

from .test_protocol import put_shard

TARGET = 24  # conftest's small_config


def _beat(run, r, peer, samples, speed=1.0, at=None):
    run.bucket.write_json(run.keys.progress(r, peer), {"peer": peer, "round": r, "samples": samples,
                                                        "samples_per_s": speed, "time": at or run.clock.time()})


def _counted(raw, r, now, timeout, target, ahead_s=0.0):
    return heartbeat.counted(heartbeat.parse(raw), r, now, timeout, target, ahead_s)


def _published(run) -> view.View:
    v = view.read(run.bucket, run.keys)
    assert v is not None
    return v


def _noise(run, seed, scale=1e-3):
    return np.random.default_rng(seed).standard_normal(run.flat.n).astype(np.float32) * scale


# what is published

def test_the_view_is_what_the_scheduler_validated(make_run):
    """Accepted shards count, after the norm screen; a manifest claiming 10^9 samples whose ranges
    do not add up, one whose chunks are missing, and a scaled-up gradient do not. Live heartbeats
    count, each clamped; stale, other-round, oversized and malformed ones do not."""
    run = on_clock(make_run(codec="int8"))
    b, k = run.bucket, run.keys
    for i, (peer, n) in enumerate([("a", 4), ("b", 4), ("c", 2)]):
        put_shard(run, 0, peer, grad=_noise(run, i), samples=n)
    put_shard(run, 0, "big", grad=_noise(run, 7) * 1000, samples=4)  # the norm screen's
    put_shard(run, 0, "liar", grad=_noise(run, 8), samples=4, manifest={"samples": 10 ** 9})
    torn = put_shard(run, 0, "torn", grad=_noise(run, 9), samples=4,
                     manifest={"samples": 10 ** 9, "data": {"stream": "torn", "ranges": [[0, 10 ** 9]]}})
    b.delete(f"{torn}/codes/c/0")  # its one object of chunks
    now = run.clock.time()
    _beat(run, 0, "p1", 5, speed=2.0)
    _beat(run, 0, "p2", 10 ** 9, speed=1e12)  # clamped: target, MAX_PEER_SPEED
    _beat(run, 0, "p3", -10 ** 9)  # clamped: 0 (still a live peer)
    _beat(run, 0, "gone", 7, at=now - 2 * run.config.peer_timeout_s)
    _beat(run, 0, "ahead", 7, at=now + 2 * run.config.peer_timeout_s)
    _beat(run, 1, "next", 7)  # a heartbeat of round 1 in round 1's folder: not this round's
    b.write_json(k.progress(0, "wrong-round"), {"round": 1, "samples": 7, "time": now})
    b.write_bytes(k.progress(0, "junk"), b"{not json")
    b.write_bytes(k.progress(0, "fat"), b'{"round": 0, "samples": 7, "time": %f}' % now + b" " * 5000)
    b.write_json(k.progress(0, "odd"), {"round": 0, "samples": "many", "time": now, "samples_per_s": "fast"})

    sched = Scheduler(run, 1, 0)
    assert sched.try_close(0) is None
    v = _published(run)
    assert (v.state, v.round, v.target, v.closed, v.stopped) == (0, 0, TARGET, False, False)
    assert (v.validated_samples, v.shards, v.rejected) == (10, 3, 3)
    assert (v.pending_samples, v.peers, v.ignored_heartbeats) == (5 + TARGET, 3, 1)
    assert v.samples_per_s == pytest.approx(2.0 + heartbeat.MAX_PEER_SPEED + 1.0 + 0.0)
    assert v.eta_s == 0.0 and v.at == v.written_at == now

    for p in ("p2", "p3"):
        b.delete(k.progress(0, p))
    sched.try_close(0)
    v = _published(run)
    assert (v.pending_samples, v.peers, v.samples_per_s) == (5, 1, pytest.approx(2.0))
    assert v.eta_s == pytest.approx((TARGET - 10 - 5) / 2.0)

    for p in ("d", "e"):  # one of 14 would count for at most 12: twice its share of the target
        put_shard(run, 0, p, grad=_noise(run, 3), samples=7)
    close = sched.try_close(0)
    assert close is not None
    v = _published(run)
    assert v.closed and (v.validated_samples, v.shards, v.rejected) == \
        (close.samples, len(close.accepted), len(close.rejected)) == (24, 5, 3)
    assert (v.pending_samples, v.peers, v.eta_s) == (0, 0, 0.0)
    run.bucket.create_json(k.stop(), {"reason": "test"})
    assert Scheduler(run, 1, 0).try_close(0) == close  # an existing CLOSE: published as it is
    v = _published(run)
    assert v.closed and v.stopped and v.validated_samples == 24


@pytest.mark.parametrize("where", ["file", "s3"])
def test_an_oversized_view_costs_its_reader_no_more_than_the_bound(tmp_path, request, where):
    """A VIEW.json of a megabyte (anyone able to write it on R2) is refused after at most
    MAX_VIEW_BYTES + 1 bytes read, by a worker's reader and by ``dedloc status`` alike, on a disk
    and on S3 (a ranged GET). Control: the object really is a megabyte."""
    bucket = Bucket(str(tmp_path / "b")) if where == "file" else request.getfixturevalue("s3_bucket")
    keys = RunLayout("test")
    bucket.write_bytes(keys.view, b'{"state": 0, "round": 0' + b" " * (1 << 20) + b"}")
    assert len(bucket.read_bytes(keys.view)) > 1 << 20  # the control
    before = bucket.stats.snapshot()["bytes_read"]
    assert view.Reader(30.0, 60.0).read(bucket, keys) is None and view.read(bucket, keys) is None
    assert bucket.stats.snapshot()["bytes_read"] - before <= 2 * (view.MAX_VIEW_BYTES + 1)


def test_a_view_out_of_bounds_is_no_view(make_run):
    run = make_run()
    Scheduler(run, 1, 0).try_close(0)
    good = run.bucket.read_bytes(run.keys.view)
    assert view.parse(good) is not None and len(good) < view.MAX_VIEW_BYTES
    assert view.parse(good[:-1] + b" " * view.MAX_VIEW_BYTES + b"}") is None
    assert view.parse(b"{not json") is None
    assert view.parse(good.replace(b'"pending_samples":0', b'"pending_samples":-5')) is None
    assert _counted(b'{"round": 0, "samples": 1e400, "time": 1.0}', 0, 1.0, 10, 24) is None
    assert _counted(b'{"round": 0, "samples": 30, "time": 1.0, "samples_per_s": NaN}', 0, 1.0, 10, 24) \
        == (24, 0.0, 0.0)
    assert _counted(b"[1, 2]", 0, 1.0, 10, 24) is None
    assert _counted(b"[" * 100000, 0, 1.0, 10, 24) is None


def test_a_heartbeat_is_projected_until_its_next_one_is_due():
    """5 s after a heartbeat of 10 samples at 4 samples/s: projected for its own next_s, at most
    the scheduler's bound; a peer that heartbeats every step is never projected."""
    def beat(**extra):
        fields = {"round": 0, "samples": 10, "time": 100.0, "samples_per_s": 4.0, **extra}
        return _counted(json.dumps(fields).encode(), 0, 105.0, 30, 1000, ahead_s=6.0)

    assert beat(next_s=2.0) == (18, 4.0, 2.0)
    assert beat() == (30, 4.0, 6.0)  # an older worker's heartbeat: the scheduler's bound
    assert beat(next_s=60.0) == (30, 4.0, 6.0)  # a claim is bounded
    assert beat(next_s=0.0) == (10, 4.0, 0.0)
    assert beat(next_s=-3.0)[0] == 10 and beat(next_s=float("nan"))[0] == 10


def test_a_heartbeat_is_written_and_parsed_as_one_record(make_run):
    """The worker's heartbeat in the bucket has its fields (``left``: true in the last one of a
    worker that left; ``landed``: its shards' samples in landed manifests), and parses back to
    itself; a claim out of bounds is clamped, a total that is no number reads as 0."""
    run = make_run()
    w = Worker(run, "a", micro_batch=4, threads=1, poll_s=0)
    w.step()
    raw = run.bucket.read_bytes(run.keys.progress(0, "a"))
    assert set(json.loads(raw)) == {"peer", "round", "samples", "sending", "samples_per_s", "next_s", "time",
                                    "uploaded_samples", "compute_s", "wall_s", "bytes_up", "bytes_down", "left",
                                    "landed", "upload_s", "held"}
    assert heartbeat.parse(raw) == w._beats[-1]
    odd = heartbeat.parse(b'{"round": 2, "time": 5, "samples_per_s": 1e12, "compute_s": "x", "bytes_up": 1e999}')
    assert (odd.round, odd.samples, odd.samples_per_s, odd.next_s) == (2, 0, heartbeat.MAX_PEER_SPEED, None)
    assert (odd.compute_s, odd.bytes_up, odd.peer) == (0.0, 0, "")
    assert heartbeat.parse(b'{"round": 0.5, "time": 1}') is None
    # the states it held and when: display and benchmarks only, bounded, or none at all
    held = heartbeat.parse(b'{"round": 3, "time": 5, "held": [[2, null, 4.0, 4.5], [3, 5.0, 5.1, 5.6]]}').held
    assert held == ((2, None, 4.0, 4.5), (3, 5.0, 5.1, 5.6))
    for odd in ('[[2, 1, 2]]', '[[2.5, 1, 2, 3]]', '[[2, 1, "x", 3]]', '[[1e999, 1, 2, 3]]', '[[2, 1, 2, null]]',
                '[[%d, 1, 2, 3]]' % 10 ** 400, '5', '[' + ', '.join(['[1, 1, 2, 3]'] * (heartbeat.HELD + 1)) + ']'):
        beat = heartbeat.parse(b'{"round": 3, "time": 5, "held": %s}' % odd.encode())
        assert beat is not None and beat.held == ()
    assert heartbeat.parse(b" " * (heartbeat.MAX_HEARTBEAT_BYTES + 1)) is None


def test_the_view_module_needs_no_torch():
    code = ("import sys, dedloc_pipeline.protocol.view, dedloc_pipeline.protocol.heartbeat, "
            "dedloc_pipeline.volunteer.upload_policy; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# claims nobody validated

def _drive(run, peers, rounds, attack, max_steps=400):
    """testing.collaborate's lock-step, with ``attack(i, r)`` run before every iteration."""
    workers = [Worker(run, name, micro_batch=mb, threads=1, poll_s=0) for name, mb in peers]
    sched = Scheduler(run, parallel=2, poll_s=0)
    with ThreadPoolExecutor(2) as pool:
        for i in range(max_steps):
            r = run.latest()
            if r >= rounds:
                return i
            attack(i, r)
            for w in workers:
                w.step()
                w.flush()
            if i % 2 == 0:
                sched.step(pool)
    raise AssertionError(f"state {rounds} not reached in {max_steps} steps")


HONEST = [("a", 4), ("b", 3), ("c", 5)]


@pytest.mark.parametrize("attack", ["manifest_ranges", "manifest_chunks", "pending_huge", "pending_negative",
                                    "everything"])
@pytest.mark.slow
def test_unvalidated_claims_cannot_stall_a_round(make_run, attack):
    """One volunteer claims 10^9 samples in a manifest (its ranges do not add up, or its chunks
    are missing), or 10^9 or -10^9 pending samples in a heartbeat refreshed every step: every
    round still fills from honest shards and closes on its target, within a bound of the honest
    collaboration's steps."""
    rounds = 2
    honest = _drive(make_run(codec="int8"), HONEST, rounds, lambda i, r: None)
    run = make_run(codec="int8", run="attacked")
    written = set()

    def inject(i, r):
        if attack.startswith("manifest") or attack == "everything":
            if r not in written:
                written.add(r)
                if attack in ("manifest_ranges", "everything"):
                    put_shard(run, r, "mallory", grad=_noise(run, r), samples=4, part="0001",
                              manifest={"samples": 10 ** 9})
                if attack in ("manifest_chunks", "everything"):
                    key = put_shard(run, r, "mallory", grad=_noise(run, r), samples=4, part="0002",
                                    manifest={"samples": 10 ** 9,
                                              "data": {"stream": "mallory", "ranges": [[0, 10 ** 9]]}})
                    run.bucket.delete(f"{key}/codes/c/0")
        if attack in ("pending_huge", "everything"):
            _beat(run, r, "mallory", 10 ** 9, speed=1e12)
        if attack == "pending_negative":
            _beat(run, r, "mallory", -10 ** 9)

    steps = _drive(run, HONEST, rounds, inject)
    assert steps <= 3 * honest + 10, (steps, honest)
    for r in range(rounds):
        close = run.bucket.read_json(run.keys.close(r))
        assert close["reason"] == "target" and close["samples"] >= TARGET
        assert {s["peer"] for s in close["accepted"]} <= {p for p, _ in HONEST}
        assert sum(s["weight"] for s in close["accepted"]) == pytest.approx(close["samples"])


# without a fresh view

def test_without_a_fresh_view_workers_compute_and_hold_until_a_scheduler_publishes(make_run):
    run = on_clock(make_run())
    workers = [Worker(run, p, micro_batch=4, threads=1, poll_s=0) for p in "abc"]

    def step_all(n=1):
        for _ in range(n):
            for w in workers:
                w.step()
                w.flush()

    # no view at all: no scheduler yet. 12 samples each (36 together) stay pending
    step_all(3)
    assert written(run, 0) == []
    assert all(w.acc.samples == 12 and w.activity == "computing" for w in workers)
    assert [run.bucket.read_json(run.keys.progress(0, p))["samples"] for p in "abc"] == [12] * 3
    # a stale view (its scheduler died long ago): the same
    sched = Scheduler(run, 1, 0)
    sched.try_close(0, now=run.clock.time() - 2 * run.config.peer_timeout_s)
    step_all()
    assert written(run, 0) == []
    assert all(w.acc.samples == 16 and w.snapshot().view is None for w in workers)
    # a scheduler publishes again: 48 pending, the round can fill, everyone uploads
    assert sched.try_close(0) is None and _published(run).pending_samples >= 48  # projected at their speed
    step_all()
    assert len(written(run, 0)) == 3 and all(w.acc is None for w in workers)
    with ThreadPoolExecutor(2) as pool:
        assert sched.step(pool) and run.latest() == 1
    # the view gone again: a new state and STOP are still noticed (LATEST, STOP read directly)
    run.bucket.delete(run.keys.view)
    step_all()
    assert all(w.state == 1 for w in workers)
    run.bucket.create_json(run.keys.stop(), {"reason": "test"})
    step_all()
    assert all(w.stopped for w in workers)


def test_a_lone_worker_without_a_view_uploads_only_a_round_it_fills_itself(make_run):
    """Nobody's count is needed for a round its own samples fill: a worker alone, with no
    scheduler, uploads the whole target once, then waits."""
    run = make_run()
    w = Worker(run, "a", micro_batch=8, threads=1, poll_s=0)
    worked = []
    for _ in range(5):
        worked.append(w.step())
        w.flush()
    assert worked == [True, True, True, False, False]
    assert w.uploads and [n for _, _, n in w.uploads] == [TARGET]


# cost

def _worker_requests(tmp_path, others: int) -> tuple[Counter, Counter]:
    url = f"file://{tmp_path}/b{others}"
    from dedloc_pipeline.protocol.run import init_run

    from .conftest import small_config
    run = init_run(Bucket(url), small_config("cost", target_batch_size=1000))
    for i in range(others):  # fast enough that the round is near its end: peers could be ahead
        _beat(run, 0, f"p{i}", 4, speed=100.0)
        put_shard(run, 0, f"p{i}", samples=4)
    w = Worker(Run(Bucket(url), "cost"), "me", micro_batch=4, threads=1, poll_s=0)
    sched = Scheduler(Run(Bucket(url), "cost"), 1, 0)
    sched.try_close(0)
    w.step()
    w.flush()
    before, s0 = Counter(w.run.bucket.stats.requests), Counter(sched.run.bucket.stats.requests)
    for _ in range(3):
        w.step()
        w.flush()
    sched.try_close(0)
    assert w.uploads == []
    return Counter(w.run.bucket.stats.requests) - before, Counter(sched.run.bucket.stats.requests) - s0


def test_a_workers_poll_costs_the_same_whatever_the_number_of_peers(tmp_path):
    """With 2 or 6 other peers: each step one GET (the view) and one PUT (its heartbeat; with
    poll_s=0 every step). The scheduler's next poll reads only what changed since the last one
    (this worker's heartbeat): the others' heartbeats and manifests are listed with their
    version tags and not read again, so it costs the same with 2 or 6 peers."""
    few, sched_few = _worker_requests(tmp_path, 2)
    many, sched_many = _worker_requests(tmp_path, 6)
    assert few == many == Counter(get=3, put=3)
    # the volunteers' one LIST, the one changed heartbeat, STOP, and the view (a heartbeat changed)
    assert sched_few == sched_many == Counter(get=1, list=1, head=1, put=1)


def test_a_scheduler_poll_where_nothing_changed_costs_a_listing_and_a_head(make_run):
    """Idle costs little: with peers' heartbeats and shards in and nothing new, a poll is the
    volunteers' LIST and STOP's HEAD; the view is not written again until something changes or
    half of peer_timeout_s has passed (the keep-alive that keeps it fresh for volunteers), and
    the next round's heartbeats (peers computing ahead) come in the same listing."""
    run = on_clock(make_run())
    for p in ("a", "b"):
        _beat(run, 0, p, 4)
        put_shard(run, 0, p, samples=4)
    sched = Scheduler(run, 1, 0, lease_s=3600.0)  # no lease renewal in these polls
    clock = run.clock
    assert sched.try_close(0) is None
    written = run.bucket.read_bytes(run.keys.view)

    def poll() -> Counter:
        before = Counter(run.bucket.stats.requests)
        assert sched.try_close(0) is None
        return Counter(run.bucket.stats.requests) - before

    clock.advance(1.0)
    assert poll() == Counter(list=1, head=1)
    assert run.bucket.read_bytes(run.keys.view) == written
    timeout = run.config.peer_timeout_s
    clock.advance(timeout * view.KEEPALIVE)
    assert poll() == Counter(list=1, head=1, put=1)  # the keep-alive
    clock.advance(timeout * (1 - view.KEEPALIVE))
    assert poll() == Counter(list=1, head=1, put=1)  # the next round's heartbeats are in the same listing
    assert view.parse(run.bucket.read_bytes(run.keys.view)).at == clock.time()
    _beat(run, 0, "a", 6)
    assert poll() == Counter(list=1, head=1, get=1, put=1)  # a new heartbeat: read, and said


def test_peers_computing_ahead_count_as_live_others(make_run):
    """The first report's panel said "0 peers" for a whole run while another worker was live:
    it computed ahead, heartbeating the next round, which the open round's count leaves out. The
    view counts such peers apart (ahead_peers), and each worker sees the others among them."""
    run = on_clock(make_run())
    _beat(run, 0, "a", 4)
    run.bucket.write_json(run.keys.progress(1, "b"), {"peer": "b", "round": 1, "samples": 8, "samples_per_s": 2.0,
                                                      "time": run.clock.time()})
    Scheduler(run, 1, 0).try_close(0)
    v = _published(run)
    assert (v.peers, v.ahead_peers, v.ahead_samples_per_s) == (1, 1, 2.0)
    b_beats = [heartbeat.parse(run.bucket.read_bytes(run.keys.progress(1, "b")))]
    seen_by_b = upload_policy.from_view(v, 0, b_beats, [], run.config.peer_timeout_s, 10.0, TARGET)
    seen_by_a = upload_policy.from_view(v, 0, [heartbeat.parse(run.bucket.read_bytes(run.keys.progress(0, "a")))], [],
                                   run.config.peer_timeout_s, 10.0, TARGET)
    assert (seen_by_b.peers, seen_by_b.ahead_peers, seen_by_b.ahead_samples_per_s) == (1, 0, 0.0)
    assert (seen_by_a.peers, seen_by_a.ahead_peers, seen_by_a.ahead_samples_per_s) == (0, 1, 2.0)


def test_a_lone_peer_sees_no_others_whichever_of_its_heartbeats_the_view_counted(make_run):
    """The report's panel said `233.0 the others'` with no other peer: the view had counted an
    older heartbeat of this peer (another speed, another count) than the one it took out. Where
    no other peer is left, what remains is its own: no others' samples, no others' speed."""
    run = on_clock(make_run())
    _beat(run, 0, "a", 4, speed=9.0)  # what the scheduler reads
    _beat(run, 1, "a", 2, speed=7.0)  # computing ahead, too
    Scheduler(run, 1, 0).try_close(0)
    v = _published(run)
    assert (v.peers, v.ahead_peers, v.pending_samples, v.samples_per_s) == (1, 1, 4, 9.0)
    run.clock.advance(0.5)
    _beat(run, 0, "a", 8, speed=3.0)  # what "a" holds as its own by the time it reads
    _beat(run, 1, "a", 2, speed=2.0)
    beats = [heartbeat.parse(run.bucket.read_bytes(run.keys.progress(r, "a"))) for r in (1, 0)]
    beats = [replace(b, time=v.at) for b in beats]  # both written at the scheduler's count, as far as "a" knows
    seen = upload_policy.from_view(v, 0, beats, [], run.config.peer_timeout_s, 10.0, TARGET)
    assert (seen.peers, seen.ahead_peers, seen.fresh_samples, seen.samples_per_s, seen.ahead_samples_per_s) == \
        (0, 0, 0, 0.0, 0.0)


def test_a_view_is_judged_stale_at_reads_not_between_them(make_run):
    """A live scheduler rewrites an unchanged view every KEEPALIVE of peer_timeout_s, so a reader
    that looks seldom (a long micro-batch: reads 25 s apart) must not call it stale for the time
    it did not look; reads peer_timeout_s apart that see no change do."""
    run = on_clock(make_run())
    clock, timeout = run.clock, run.config.peer_timeout_s
    sched = Scheduler(run, 1, 0, lease_s=3600.0)
    reader = view.Reader(timeout, run.config.cadence.heartbeat_max_s, clock)
    sched.try_close(0)
    reader.read(run.bucket, run.keys)
    for _ in range(8):  # the scheduler polls every 5 s, the reader looks every 25 s
        for _ in range(5):
            clock.advance(5.0)
            sched.try_close(0)
        assert reader.read(run.bucket, run.keys) is not None and reader.fresh
    clock.advance(timeout + 5.0)  # the scheduler died: between reads nothing is judged
    assert reader.fresh
    reader.read(run.bucket, run.keys)
    assert not reader.fresh


def test_in_long_rounds_the_view_is_kept_alive_as_seldom_as_a_heartbeat(make_run, monkeypatch):
    """The view changes with each wave of heartbeats and shards; its keep-alive alone says that a
    scheduler is there. After a 100 s round it is rewritten unchanged 60 s after the last write (a
    heartbeat's keep-alive: 0.6 of the round), not every 20 s, and says so (next_s): a reader
    calls it fresh 65 s unchanged and stale at 75 s (the keep-alive plus a third of
    peer_timeout_s), where a view of short rounds is stale at peer_timeout_s."""
    run = on_clock(make_run())
    clock, timeout, cap = run.clock, run.config.peer_timeout_s, run.config.cadence.heartbeat_max_s
    sched = Scheduler(run, 1, 0, lease_s=3600.0)
    assert sched.keepalive_s == timeout * view.KEEPALIVE  # no round seen yet
    _beat(run, 0, "a", 4)
    assert sched.try_close(0) is None  # the round's first work
    clock.advance(100.0)
    put_shard(run, 0, "a", samples=TARGET)
    close = sched.try_close(0)
    assert close is not None and close.closed_at - close.started_at == pytest.approx(100.0)
    assert sched.keepalive_s == pytest.approx(60.0)
    with ThreadPoolExecutor(2) as pool:
        sched.finish(0, pool)
    written = []
    write = view.write
    monkeypatch.setattr(view, "write", lambda *a: (written.append(clock.monotonic()), write(*a)))
    for _ in range(40):  # round 1: nobody computing, a poll every 5 s for 200 s
        assert sched.try_close(1) is None
        clock.advance(5.0)
    gaps = [b - a for a, b in zip(written, written[1:])]
    assert len(gaps) == 3 and all(g == pytest.approx(60.0) for g in gaps), written
    assert view.parse(run.bucket.read_bytes(run.keys.view)).next_s == pytest.approx(60.0)
    reader = view.Reader(timeout, cap, clock)
    assert sched.try_close(1) is None  # a write is due now: 200 s after the first
    reader.read(run.bucket, run.keys)
    assert reader.lifetime == pytest.approx(70.0)
    clock.advance(65.0)
    reader.read(run.bucket, run.keys)
    assert reader.fresh
    clock.advance(10.0)
    reader.read(run.bucket, run.keys)
    assert not reader.fresh
    assert view.lifetime(view.View(state=0, round=0, target=1, at=0.0, written_at=0.0, next_s=1e9), timeout, cap) \
        == cap + timeout / 3  # a view claiming to stand for ever counts no longer than a heartbeat


def test_the_scheduler_polls_every_scheduler_poll_s_and_as_the_keepalive_falls_due(make_run, monkeypatch):
    """Far from the target (nobody computing) the scheduler polls every cadence.scheduler_poll_s
    (20 s): one LIST each, and the view rewritten at the poll its keep-alive falls due, never
    later (a poll is moved up to it), so a reader never sees it unchanged for peer_timeout_s."""
    run = on_clock(make_run(peer_timeout_s=36.0))  # a keep-alive of 24 s: off the 20 s polls
    clock = run.clock
    sched = Scheduler(run, 1, lease_s=3600.0)
    written = []
    write = view.write
    monkeypatch.setattr(view, "write", lambda *a: (written.append(clock.monotonic()), write(*a)))
    start, before = clock.monotonic(), Counter(run.bucket.stats.requests)
    assert sched.wait_close(0, deadline=start + 200.0) is None
    polls = (Counter(run.bucket.stats.requests) - before)["list"]
    keepalive = run.config.peer_timeout_s * view.KEEPALIVE
    assert run.config.cadence.scheduler_poll_s == 20.0
    # and the next round's heartbeats every 36 s (nobody computing: anyone may be ahead)
    assert 200 / 20 + 200 / 36 <= polls <= 200 / 20 + 200 / keepalive + 200 / 36 + 2
    gaps = [b - a for a, b in zip(written, written[1:])]
    assert gaps and max(gaps) <= keepalive + 1e-9 and min(gaps) >= keepalive - 1e-9


def test_a_worker_computing_ahead_reads_the_view_seldom_while_its_round_is_reduced(make_run):
    """Once its round is full, a worker with delayed updates computes ahead: the next state is
    all it waits for, so it reads the view at a share of the wait so far (not every
    poll_min_s): during a reduction held for 40 s, about 10 reads, not 40. It still moves to
    the state as soon as a read names it, and every sample counts once."""
    run = on_clock(make_run(target_batch_size=200))
    workers = [Worker(run, p, micro_batch=4, threads=1, delayed=True) for p in ("a", "b")]
    sched = Scheduler(run, 1)

    def tick():
        for w in workers:
            w.step()
            w.flush()
        run.clock.sleep(1.0)

    with ThreadPoolExecutor(2) as pool:
        while run.latest() < 2:  # the workers learn how long a reduction takes
            tick()
            sched.step(pool)
        while sched.try_close(2) is None:
            tick()
        looked = {w.peer: w.follower.looked for w in workers}
        reads = Counter()
        for _ in range(40):  # closed, and not reduced for 40 s
            tick()
            for w in workers:
                reads[w.peer] += w.follower.looked != looked[w.peer]
                looked[w.peer] = w.follower.looked
        assert all(w.state == 2 and w.acc.round == 3 for w in workers)  # computing ahead throughout
        assert all(4 <= n <= 12 for n in reads.values()), reads
        assert sched.step(pool) and run.latest() == 3
        for _ in range(int(run.config.cadence.poll_max_s) + 2):  # the next state's view is read within poll_max_s
            tick()
            sched.try_close(3)
        assert all(w.state == 3 for w in workers)
        for w in workers:
            w.leave()
    assert_counted_once(run)


# when the CLOSE waits, and how soon the scheduler looks again

def _peers_of(close) -> list[str]:
    return sorted(e.peer for e in close.accepted)


def _filled_by_two(run, sched, r: int) -> None:
    """Round r: a, b and c heartbeat its first work; 8 s later a and b send 12 samples each (the
    target) while c, with 8 samples of it, has sent none."""
    for p in ("a", "b", "c"):
        _beat(run, r, p, 4, speed=1.0)
    assert sched.try_close(r) is None  # the round's first work: its time runs from here
    run.clock.advance(8.0)
    put_shard(run, r, "a", samples=12)
    put_shard(run, r, "b", samples=12)
    _beat(run, r, "c", 8)


def test_the_close_waits_a_share_of_the_fill_for_live_volunteers_that_sent_nothing_yet(make_run):
    """Two parts reach the target while a third live volunteer, with samples of the round, has
    sent none: CLOSE waits for it (it sends at once once it sees the round full; closed a poll
    earlier, its samples would be lost), at most ``close.grace`` of the time the round took to
    fill. One that never sends is closed without, and not waited for in the next round until it
    sends a part again."""
    run = on_clock(make_run())
    clock, sched = run.clock, Scheduler(run, 1, 0)
    _filled_by_two(run, sched, 0)
    assert sched.try_close(0) is None and _published(run).validated_samples == TARGET  # full, and waiting
    clock.advance(1.0)
    put_shard(run, 0, "c", samples=8)
    close = sched.try_close(0)
    assert close is not None and _peers_of(close) == ["a", "b", "c"] and close.samples == 32

    with ThreadPoolExecutor(2) as pool:
        sched.finish(0, pool, close)
        clock.advance(1.0)
        _filled_by_two(run, sched, 1)
        assert sched.try_close(1) is None
        clock.advance(0.25 * 8.0 - 0.01)
        _beat(run, 1, "c", 8)
        assert sched.try_close(1) is None  # still within the grace
        clock.advance(0.02)
        close = sched.try_close(1)  # c sent nothing: closed without it
        assert close is not None and _peers_of(close) == ["a", "b"]

        sched.finish(1, pool, close)
        _filled_by_two(run, sched, 2)
        close = sched.try_close(2)  # waited for in vain last round: not again, until it sends a part
        assert close is not None and _peers_of(close) == ["a", "b"]


def test_a_close_never_waits_without_a_grace_or_past_its_timeout(make_run):
    run = on_clock(make_run(close={"grace": 0.0}))
    sched = Scheduler(run, 1, 0)
    _filled_by_two(run, sched, 0)
    close = sched.try_close(0)
    assert close is not None and _peers_of(close) == ["a", "b"]


def test_a_new_rounds_eta_keeps_the_last_rounds_speed_until_its_volunteers_heartbeat_again(make_run):
    """Each volunteer heartbeats the new round once it holds the new state: the first heartbeat
    alone would make the round look slow, and the scheduler would look again (and tell the
    volunteers to) only after the target had passed."""
    run = on_clock(make_run())
    sched = Scheduler(run, 1, 0)
    for p in ("a", "b", "c"):
        _beat(run, 0, p, 2, speed=2.0)
    sched.try_close(0)
    assert _published(run).eta_s == pytest.approx((TARGET - 6) / 6.0)
    for p in ("a", "b", "c"):
        put_shard(run, 0, p, samples=8)
    close = sched.try_close(0)
    with ThreadPoolExecutor(2) as pool:
        sched.finish(0, pool, close)
    _beat(run, 1, "a", 2, speed=2.0)
    sched.try_close(1)
    assert _published(run).eta_s == pytest.approx((TARGET - 2) / 6.0)  # b and c still to say: as fast as before
    _beat(run, 1, "b", 2, speed=2.0)
    _beat(run, 1, "c", 0, speed=0.0)  # c says it stopped
    sched.try_close(1)
    assert _published(run).eta_s == pytest.approx((TARGET - 4) / 4.0)  # all said: their own speeds


def test_a_new_scheduler_whose_volunteers_wait_looks_again_soon_then_backs_off(make_run):
    """Workers stop computing while no scheduler is there; a new one sees them live and none
    computing (no ETA). They go on once they read its view, so it looks again after poll_min_s,
    then twice that, and so on up to its slowest poll, until their speed gives an ETA again:
    before, it slept its slowest poll (20 s) and the first round after a restart waited for it."""
    run = on_clock(make_run())
    cadence, sched = run.config.cadence, Scheduler(run, 1)
    for p in ("a", "b"):
        _beat(run, 0, p, 4, speed=0.0)
    waits = []
    for _ in range(8):
        sched.try_close(0)
        waits.append(sched._wait())
    assert waits[:3] == [cadence.poll_min_s, 2 * cadence.poll_min_s, 4 * cadence.poll_min_s]
    assert waits[-1] == cadence.scheduler_poll_s and waits == sorted(waits)
    _beat(run, 0, "a", 4, speed=2.0)
    sched.try_close(0)
    assert sched._wait() == cadence.scheduler_s((TARGET - 8) / 2.0)
    for p in ("a", "b"):
        put_shard(run, 0, p, samples=12)
    with ThreadPoolExecutor(2) as pool:
        sched.finish(0, pool, sched.try_close(0))
    for p in ("a", "b"):
        _beat(run, 1, p, 4, speed=0.0)
    sched.try_close(1)
    assert sched._wait() == cadence.poll_min_s  # a new round backs off from the start again


def test_a_scheduler_stopped_as_it_commits_names_the_new_state_in_its_last_view(make_run):
    run = on_clock(make_run())
    sched = Scheduler(run, 1, 0)
    for p in ("a", "b"):
        put_shard(run, 0, p, samples=12)
    with ThreadPoolExecutor(2) as pool:
        sched.finish(0, pool, sched.try_close(0))
    sched.end(0, "rounds")  # its last poll saw round 0 open
    v = _published(run)
    assert (v.state, v.closed, v.ended) == (1, False, "the scheduler reached its last round (--until-round)")


def test_a_rounds_eta_is_never_slower_than_the_last_rounds_own_pace(make_run):
    """Volunteers back from a long wait claim a speed their smoothing has not caught up with yet:
    the ETA takes the last round's pace by the scheduler's clock (its samples over its length)
    when that is faster, so the scheduler does not sleep past a full round."""
    run = on_clock(make_run())
    sched = Scheduler(run, 1, 0)
    for p in ("a", "b", "c"):
        _beat(run, 0, p, 0, speed=2.0)
    sched.try_close(0)  # its first work
    run.clock.advance(4.0)
    for p in ("a", "b", "c"):
        put_shard(run, 0, p, samples=8)
    close = sched.try_close(0)
    assert close is not None  # 24 samples in 4 s: 6 a second
    with ThreadPoolExecutor(2) as pool:
        sched.finish(0, pool, close)
    for p in ("a", "b", "c"):
        _beat(run, 1, p, 2, speed=0.5)  # all three heartbeat again, slow by their own count
    sched.try_close(1)
    assert _published(run).eta_s == pytest.approx((TARGET - 6) / 6.0)
