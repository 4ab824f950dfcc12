"""Benchmark 12: recovery after a scheduler outage, with real processes on a loaded machine.

``dedloc aggregate`` and two ``dedloc worker`` processes (``tiny``, ``file://``) run beside
``load`` busy processes (one per core: the machine is as busy as an outsider's was). Once state
``stop_at`` is committed the scheduler is stopped (SIGTERM, as Ctrl-C would), stays away for
``outage_s`` seconds, and a new one is started. For every state, how late each worker held it
after its COMMIT (the workers' heartbeats, ``Heartbeat.held``): before the outage, the state
the outage delays, and each state after the new scheduler's first; and the rounds per second
before and after. Back at full speed within one round means: from the new scheduler's second
state on, the lag is what it was before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from . import collab, latency, tables


def _busy() -> None:
    while True:
        pass


def run(outage_s: float = 30.0, stop_at: int = 4, end: int = 12, load: int | None = None,
        timeout_s: float = 600) -> dict:
    from dedloc_pipeline.protocol.config import recipe_config
    from dedloc_pipeline.protocol.run import init_run
    from dedloc_pipeline.storage.bucket import Bucket

    tmp = Path(tempfile.mkdtemp(prefix="dedloc-recovery-"))
    url = f"file://{tmp}/bucket"
    run_ = init_run(Bucket(url), recipe_config("bench", "tiny", target_batch_size=64, micro_batch=8, codec="int8"))
    common = ["--bucket", url, "--run", "bench", "--until-round", str(end)]
    logs: list = []

    def start(name: str, *args: str) -> subprocess.Popen:
        logs.append(open(tmp / f"{name}.log", "a"))
        return subprocess.Popen([collab.DEDLOC, *args, *common], env=collab.ENV, stdout=logs[-1],
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    import multiprocessing
    hogs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(load or os.cpu_count())]
    for h in hogs:
        h.start()
    peers = ["peer-0", "peer-1"]
    procs = {"scheduler": start("scheduler", "aggregate")}
    procs.update({p: start(p, "worker", "--peer-id", p, "--threads", "1") for p in peers})
    recorder = latency.Recorder(run_.bucket, run_.keys, peers)
    deadline = time.monotonic() + timeout_s
    try:
        def wait_for(state: int) -> None:
            while not run_.bucket.exists(run_.keys.commit(state)):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs.values()):
                    raise RuntimeError(f"recovery: state {state} never came (logs in {tmp})")
                recorder.observe()
                time.sleep(0.5)
        wait_for(stop_at)
        procs["scheduler"].send_signal(signal.SIGINT)
        procs["scheduler"].wait(timeout=60)
        stopped = time.time()
        while time.time() - stopped < outage_s:
            recorder.observe()
            time.sleep(0.5)
        back = run_.latest()
        procs["scheduler"] = start("scheduler", "aggregate")
        restarted = time.time()
        wait_for(end)
        for p in peers:
            procs[p].wait(timeout=120)
        recorder.observe()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for h in hogs:
            h.terminate()
        for f in logs:
            f.close()
    committed = {s: run_.commit_of(s)["committed_at"] for s in range(1, end + 1)}
    lag = {s: max(recorder.held[(p, s)][2] for p in peers) - committed[s]
           for s in range(2, end + 1) if all((p, s) in recorder.held for p in peers)}
    first = min(s for s in committed if committed[s] > restarted)
    before = [lag[s] for s in range(2, stop_at) if s in lag]
    after = [lag[s] for s in range(first + 1, end + 1) if s in lag]
    return {"outage_s": outage_s, "load_processes": len(hogs), "stopped_at_state": stop_at, "state_at_return": back,
            "first_state_after": first, "lag_s": {str(s): v for s, v in lag.items()},
            "lag_before_s": max(before), "lag_after_s": max(after),
            "rounds_per_s_before": (stop_at - 2) / (committed[stop_at] - committed[2]),
            "rounds_per_s_after": (end - first) / (committed[end] - committed[first])}


def table(res: dict):
    rows = [["before the outage (worst)", res["lag_before_s"], res["rounds_per_s_before"]],
            [f"state {res['stopped_at_state']}: committed as the scheduler stopped",
             res["lag_s"].get(str(res["stopped_at_state"]), "-"), "-"],
            [f"state {res['first_state_after']}: the new scheduler's first", res["lag_s"].get(
                str(res["first_state_after"]), "-"), "-"],
            ["after it (worst)", res["lag_after_s"], res["rounds_per_s_after"]]]
    return tables.table(f"12. recovery: the scheduler stopped {res['outage_s']:.0f} s, "
                        f"{res['load_processes']} busy processes beside (tiny, 2 workers, target 64)",
                        ["", "state held after its COMMIT, s", "rounds/s"], rows)
