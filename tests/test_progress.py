"""What a volunteer sees: the progress display, Ctrl-C in the middle of an upload, and join()."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from rich.console import Console

import dedloc_pipeline
from dedloc_pipeline.checks import catalog
from dedloc_pipeline.monitoring.display import Display
from dedloc_pipeline.monitoring.uploads import Uploads
from dedloc_pipeline.monitoring.volunteer import summary, summary_text
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.protocol.view import RoundView
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import collaborate, written

from .conftest import small_config


class Lines(io.StringIO):
    """A console's file that says when ``n`` lines were written to it."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.enough = n, threading.Event()

    def write(self, text: str) -> int:
        got = super().write(text)
        if self.getvalue().count("\n") >= self.n:
            self.enough.set()
        return got


def test_display_shows_the_worker_and_the_ledger(make_run):
    """Two peers fill round 0; then alice computes one micro-batch of round 1 while bob's heartbeat
    says 8 samples pending at 2 samples/s: 12 of 24 in, 12 to go at 2/s (alice's own speed is not
    known at the first look), and everything alice uploaded counted in COMMIT 1."""
    run = make_run()
    alice, _ = collaborate(run, [("alice", 4), ("bob", 4)], rounds=1)
    mine = [s for s in run.commit_of(1)["shards"] if s["peer"] == "alice"]
    assert mine and sum(s["samples"] for s in mine) == alice.uploaded_samples
    run.bucket.write_json(run.keys.progress(1, "bob"), {"peer": "bob", "round": 1, "samples": 8,
                                                         "samples_per_s": 2.0, "time": time.time()})
    Scheduler(run, 1, 0).try_close(1)  # the scheduler's round view: what alice reads of bob
    alice.sync()  # at state 1 (a step would only start its download)
    alice.step()
    alice.flush()
    display = Display(alice, plain=True, console=Console(file=io.StringIO()))
    f = display.facts()
    assert f["snapshot"].state == 1 and f["activity"] == "computing round 1"
    assert (f["manifest"], f["others"], f["mine"], f["peers"]) == (0, 8, 4, 1)
    assert f["eta_s"] == pytest.approx(6.0) and f["counted"] == alice.uploaded_samples

    line = display.line(f)
    assert "\x1b" not in line
    for part in ("alice state 1: computing round 1", "round 1 12/24 (50%) ETA 0:00:06",
                 f"4 pending, {alice.uploaded_samples} uploaded in {len(mine)} shards, "
                 f"{alice.uploaded_samples} counted", "others 2.0, 1 peers"):
        assert part in line, line
    term = Console(file=io.StringIO(), force_terminal=True, width=140)
    term.print(display.panel(f))
    assert "12/24 (50%) · ETA 0:00:06" in term.file.getvalue()

    s = summary(alice, "until_round", Uploads(run))
    assert (s["samples_uploaded"], s["shards"], s["rounds"]) == (alice.uploaded_samples, len(mine), 1)
    assert (s["samples_counted"], s["shards_counted"], s["samples_open"], s["rejected"]) == \
        (alice.uploaded_samples, len(mine), 0, [])
    text = summary_text(s)
    assert "alice: stopped at state 1 (state reached)" in text
    assert f"counted   {alice.uploaded_samples} samples ({len(mine)} shards)" in text

    # drawn from its own thread: a line every `every` seconds, none with escape codes (waited
    # for as they come, however slowly the machine draws them)
    out = Lines(2)
    with Display(alice, plain=True, every=0.05, console=Console(file=out)):
        assert out.enough.wait(60), out.getvalue()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(ln.count(" alice state 1: ") == 1 and "\x1b" not in ln for ln in lines)


@pytest.mark.slow
def test_the_panel_says_a_state_is_being_downloaded_and_counts_this_peers_shards(make_run):
    """The report: `round 6 is full: computing round 7 ahead | round 6 0/256 (0%) ETA unknown`
    while the next state was on its way: the view in hand was older than this peer's own shard.
    While a committed state downloads the panel says so, and the round shows at least what this
    peer sent to it."""
    run = make_run()
    alice, _ = collaborate(run, [("alice", 4), ("bob", 4)], rounds=1)
    display = Display(alice, plain=True, console=Console(file=io.StringIO()))
    snap = alice.snapshot()
    mine = sum(n for r, _, n in snap.uploads if r == 0)
    stale = replace(snap, state=0, round=1, pending=4, fetching=1, view=None)  # state 1 on its way, 4 computed ahead
    display._view = (0, replace(snap.view, manifest_samples=0, fresh_samples=0), 0.0) if snap.view else (0, None, 0.0)
    alice.snapshot = lambda: stale
    f = display.facts()
    assert f["activity"] == "state 1 committed: downloading it, computing round 1 meanwhile"
    assert f["full"] and f["manifest"] == mine > 0
    line = display.line(f)
    assert f"round 0 {mine}/24" in line and "closed" in line, line

def test_while_a_round_is_reduced_the_panel_shows_the_others_as_its_last_open_view_had_them(make_run):
    """The report: `(others 0.0, 0 peers)` beside live peers. A closed view counts only the peers
    already heartbeating the next round at its CLOSE; while the round is reduced the panel shows
    the others as the round's last open view had them, dated from that read. A closed view that
    counts more (the others computing ahead) is shown as it is."""
    run = make_run()
    alice, _ = collaborate(run, [("alice", 4), ("bob", 4)], rounds=1)
    display = Display(alice, plain=True, console=Console(file=io.StringIO()))
    snap = replace(alice.snapshot(), fetching=None, view_age_s=0.0)
    shown = []
    for v in (RoundView(peers=2, samples_per_s=5.0), RoundView(closed=True),
              RoundView(closed=True, ahead_peers=3, ahead_samples_per_s=7.0)):
        alice.snapshot = lambda v=v: replace(snap, view=v)
        f = display.facts()
        shown.append((f["peers"], f["others_per_s"], display.line(f)))
    assert [x[:2] for x in shown] == [(2, 5.0), (2, 5.0), (3, 7.0)]
    assert "2 peers, as of " in shown[1][2]


def test_join_returns_the_summary(make_run, bucket, capsys):
    """The notebook API: alone with a scheduler, until state 1, then until another thread says stop."""
    run = make_run()
    sched = threading.Thread(target=Scheduler(run, parallel=1, poll_s=0.05).serve, args=(1,), daemon=True)
    sched.start()
    s = dedloc_pipeline.join(bucket=bucket.url, run=run.name, peer_id="alice", device="cpu", until_round=1,
                             threads=1, poll=0.1, plain=True, every=0.5)
    sched.join(30)
    assert s["ended"] == "until_round" and s["state"] == 1
    assert (s["samples_uploaded"], s["shards"], s["rounds"], s["samples_counted"]) == (24, 1, 1, 24)
    out = capsys.readouterr().out
    assert "alice: stopped at state 1 (state reached)" in out and "\x1b" not in out

    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    s = dedloc_pipeline.join(bucket=bucket.url, run=run.name, peer_id="alice", device="cpu", threads=1,
                             poll=0.1, plain=True, stop=stop)
    assert s["ended"] == "stop_requested" and s["state"] == 1
    progress = run.bucket.read_json(run.keys.progress(1, "alice"))
    assert progress["samples"] == 0  # left: its pending samples withdrawn


# Ctrl-C (or SIGTERM, as systemd and docker stop a service) sent from inside the first chunk write
# of the first shard (at the main thread, as a terminal does), once or twice a second apart; every
# chunk write of that shard waits meanwhile. Unloaded the pair takes 11 s, beside four CPU-bound
# processes 22-30 s; once, in a loaded CI run, the first was still running at 100 s. A process
# still running at HANG_S prints every thread's stack (faulthandler) and exits, so a hang says
# where it is.
HANG_S = 240
INTERRUPTED_WORKER = f"""
import faulthandler
faulthandler.dump_traceback_later({HANG_S}, exit=True)
import asyncio, os, signal, sys, threading
# As a terminal starts it: a process inherits ignored and blocked signals from whatever started
# it (a script's background job ignores SIGINT), and the first press was once lost in a loaded CI
# run with the worker waiting on; say so if this one inherited either, then start clean.
SIGS = set((signal.SIGINT, signal.SIGTERM))
inherited = [signal.Signals(s).name + " ignored" for s in SIGS if signal.getsignal(s) is signal.SIG_IGN]
inherited += [signal.Signals(s).name + " blocked" for s in signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGS) & SIGS]
if inherited:
    print("inherited:", ", ".join(inherited), flush=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from dedloc_pipeline.cli import app
from dedloc_pipeline.storage import bucket as storage

presses, write, pressed = int(os.environ["PRESSES"]), storage._BucketStore.set, []
sig = getattr(signal, os.environ["SIGNAL"])

async def slow_set(self, key, value):
    if key.startswith("c/"):
        if not pressed:
            pressed.append(key)
            print("pressed during the write of", key, flush=True)
            for _ in range(presses):
                signal.pthread_kill(threading.main_thread().ident, sig)
                await asyncio.sleep(1.0)
        else:
            await asyncio.sleep(0.2)
    await write(self, key, value)

storage._BucketStore.set = slow_set
app(sys.argv[1:], prog_name="dedloc")
"""


@pytest.mark.slow
@pytest.mark.timeout(2 * HANG_S + 120)
def test_ctrl_c_during_an_upload_leaves_the_bucket_consistent(tmp_path):
    """Alone in a run of target 8 a worker uploads after two micro-batches. One Ctrl-C during the
    chunk writes: the shard completes, manifest last, and the summary counts it; one SIGTERM does
    the same. Two: the shard is abandoned before its manifest. Either way every manifest's chunks
    are there and whole, the heartbeat withdraws the pending samples, and the exit status is 130
    (143 after SIGTERM)."""
    procs = {}
    try:
        for presses, sig in ((1, "SIGINT"), (2, "SIGINT"), (1, "SIGTERM")):  # at once: most is importing torch
            url = f"file://{tmp_path}/b{presses}{sig}"
            init_run(Bucket(url), small_config("r", target_batch_size=8, micro_batch=4))
            env = dict(os.environ, PRESSES=str(presses), SIGNAL=sig, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            procs[presses, sig] = (url, subprocess.Popen(
                [sys.executable, "-c", INTERRUPTED_WORKER, "worker", "--bucket", url, "--run", "r",
                 "--peer-id", "alice", "--threads", "1", "--poll", "0.2", "--device", "cpu", "--plain"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for (presses, sig), (url, p) in procs.items():
            out, _ = p.communicate(timeout=HANG_S + 30)  # faulthandler ends it first
            run = Run(Bucket(url), "r")
            manifests = written(run, 0)
            for m in manifests:  # the scheduler's own checks: chunks present, checksums right
                catalog.validate(run, 0, run.keys.shard_of(m), run.bucket.read_bytes(m))
            assert p.returncode == (143 if sig == "SIGTERM" else 130), out
            assert run.bucket.read_json(run.keys.progress(0, "alice"))["samples"] == 0, out
            assert "pressed during the write of c/" in out, out  # the upload had begun
            if presses == 1:
                assert len(manifests) == 1, out
                assert f"stopped cleanly after {'SIGTERM' if sig == 'SIGTERM' else 'Ctrl-C'}" in out, out
                assert "uploaded  8 samples in 1 shards" in out, out
                assert "open      8 samples in rounds not committed yet" in out, out
            else:
                assert manifests == [], out
                assert "(interrupted)" in out and "uploaded  0 samples in 0 shards" in out, out
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                p.kill()
