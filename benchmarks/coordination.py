"""Benchmark 7: coordination at scale, requests counted by the S3 server itself (``idle``: 3 and 16
volunteers at 20 s and 100 s rounds, the scheduler's requests shared among them).

4, 16 and 64 simulated volunteers against moto's S3 server on loopback. Each runs the real
worker (``volunteer/worker.py``: round view, cadence, heartbeats, the upload decision, shard
uploads and state downloads on its transfer thread) with one thing replaced: ``Worker.train``
sleeps for the time a micro-batch would take (``step_s``) and adds a constant to the gradients,
so that shards have real chunks to upload. Volunteers run as threads of a few host processes
(a process each would need 64 interpreters on two cores); the scheduler is ``Scheduler.serve``'s
loop in its own process. The target is sized so that a round fills in ``round_s`` seconds
whatever the number of peers.

Measured between the warm-up's COMMIT and the last one:
- requests per volunteer per second, by class, as moto's request log has them (one line per
  request answered), less the scheduler's own (counted where botocore sends them, which equals
  the server's count: tests/test_requests.py); and the scheduler's per second;
- close latency: when the samples each round's CLOSE accepted, taken in the order they were
  computed, reached the target, and how long after that the CLOSE was written; median, worst;
  split at the moment the shards making the target had all landed (uploading, then closing);
- the bill of those requests per volunteer-day (planning/estimate.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from dedloc_pipeline.testing import moto_log

ROOT = Path(__file__).resolve().parents[1]
MICRO_BATCH = 8
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", AWS_ACCESS_KEY_ID="testing",
           AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", PYTHONUNBUFFERED="1")


def server_log(path: Path) -> list[tuple[float, str]]:
    """(unix second, request class) of every request moto answered."""
    return [(x.at, x.kind) for x in moto_log(path)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the two kinds of child process

def _bucket(url: str, endpoint: str):
    from dedloc_pipeline.storage.bucket import Bucket
    return Bucket(url, endpoint_url=endpoint)


def scheduler_main(url: str, endpoint: str, run_name: str, until: int, out: str) -> None:
    """``Scheduler.serve``'s loop, recording its own request counts at every commit."""
    from concurrent.futures import ThreadPoolExecutor

    from dedloc_pipeline.organizer.scheduler import Scheduler, stop_reason
    from dedloc_pipeline.protocol.run import Run

    sched = Scheduler(Run(_bucket(url, endpoint), run_name))
    marks = []
    with ThreadPoolExecutor(2) as pool:
        while stop_reason(snap := sched.poll(), until) is None:
            if snap.close or sched.wait_close(snap.state):
                sched.finish(snap.state, pool)
                marks.append({"state": snap.state + 1, "time": time.time(), **sched.run.bucket.stats.snapshot()})
    Path(out).write_text(json.dumps(marks))


def volunteers_main(url: str, endpoint: str, run_name: str, names: list[str], step_s: float, until: int,
                    out: str) -> None:
    """Simulated volunteers as threads: the real Worker, its training step a timed sleep."""
    import torch

    from dedloc_pipeline.protocol.run import Run
    from dedloc_pipeline.volunteer.worker import Worker

    class Simulated(Worker):
        def train(self, cursor: int, n: int) -> float:
            time.sleep(step_s)
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.add_(1e-3 * n)
            computed.append((time.time(), self.peer, cursor, n))
            return 2.0 * n

        def _send(self, *args, **kw):  # when each shard's manifest landed (observed, not changed)
            key = super()._send(*args, **kw)
            landed[key] = time.time()
            return key

    torch.set_num_threads(1)
    computed: list[tuple[float, str, int, int]] = []  # (when, peer, stream position, samples)
    landed: dict[str, float] = {}  # shard -> when its upload finished
    workers = [Simulated(Run(_bucket(url, endpoint), run_name), name, micro_batch=MICRO_BATCH) for name in names]
    threads = [threading.Thread(target=w.serve, args=(until,), name=w.peer) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps({"computed": computed, "landed": landed,
                                     "requests": [w.run.bucket.stats.snapshot() for w in workers]}))


# the parent

def case(peers: int, round_s: float = 40.0, step_s: float = 0.5, warmup: int = 1, rounds: int = 3,
         hosts: int = 4, timeout_s: float = 900) -> dict:
    """One collaboration of ``peers`` simulated volunteers; its requests and close latencies."""
    from dedloc_pipeline.protocol.config import recipe_config
    from dedloc_pipeline.protocol.run import Run, init_run

    work = Path(tempfile.mkdtemp(prefix=f"dedloc-coord-{peers}-"))
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = work / "moto.log"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env=ENV, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    procs: list[subprocess.Popen] = []
    try:
        os.environ.update({k: ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
        name, url = f"coord{peers}", f"s3://coord{peers}/c"
        deadline = time.monotonic() + 30
        while True:
            try:
                _bucket(f"s3://coord{peers}", endpoint).fs.mkdir(f"coord{peers}")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        speed = MICRO_BATCH / step_s  # samples/s of one volunteer
        target = int(peers * speed * round_s)
        cfg = recipe_config(name, "tiny", target_batch_size=target, micro_batch=MICRO_BATCH, seq_len=32)
        init_run(_bucket(url, endpoint), cfg)
        until = warmup + rounds
        common = [url, endpoint, name]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.coordination", "scheduler", *common, str(until), str(work / "s.json")],
            cwd=ROOT, env=ENV, stdout=open(work / "scheduler.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True))
        names = [f"v{i:02d}" for i in range(peers)]
        groups = [names[i::hosts] for i in range(min(hosts, peers))]
        for i, group in enumerate(groups):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.coordination", "volunteers", *common, ",".join(group),
                 str(step_s), str(until), str(work / f"v{i}.json")],
                cwd=ROOT, env=ENV, stdout=open(work / f"host{i}.log", "wb"), stderr=subprocess.STDOUT,
                start_new_session=True))
        end = time.monotonic() + timeout_s
        for p in procs:
            p.wait(max(1.0, end - time.monotonic()))
            if p.returncode:
                raise RuntimeError(f"a benchmark process failed (exit {p.returncode}); logs in {work}")
        marks = json.loads((work / "s.json").read_text())
        hosts_out = [json.loads((work / f"v{i}.json").read_text()) for i in range(len(groups))]
        run = Run(_bucket(url, endpoint), name)
        closes = {r: run.bucket.read_json(run.keys.close(r)) for r in range(until)}
        requests = server_log(log)
    finally:
        for p in [*procs, server]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    return _summary(peers, target, round_s, step_s, warmup, marks, hosts_out, closes, requests)


def _summary(peers, target, round_s, step_s, warmup, marks, hosts_out, closes, requests) -> dict:
    from dedloc_pipeline.planning.estimate import measured

    at = {m["state"]: m for m in marks}
    first, last = at[warmup], at[max(at)]
    window = last["time"] - first["time"]
    # whole seconds in the server's log: the window's ends are rounded to them
    served = Counter(k for t, k in requests if int(first["time"]) < t <= int(last["time"]))
    mine = Counter({k: last["requests"].get(k, 0) - first["requests"].get(k, 0) for k in last["requests"]})
    volunteer = served - mine
    # close latency: the samples a round's CLOSE accepted (their stream ranges), in the order they
    # were computed; the target was reached when they add up to it, and CLOSE came that long after
    # (split: until the shards that make the target had landed, and from then to CLOSE)
    when = {(peer, cursor): (t, n) for h in hosts_out for t, peer, cursor, n in h["computed"]}
    landed = {k: t for h in hosts_out for k, t in h["landed"].items()}
    latency, uploading, closing = [], [], []
    for r in range(warmup, max(at)):
        accepted = closes[r]["accepted"]
        batches = sorted(when[s["data"]["stream"], c] for s in accepted for a, k in s["data"]["ranges"]
                         for c in range(a, a + k, MICRO_BATCH) if (s["data"]["stream"], c) in when)
        reached = _reached(batches, target)
        full = _reached(sorted((landed[s["key"]], s["samples"]) for s in accepted if s["key"] in landed), target)
        if reached is not None:
            latency.append(closes[r]["closed_at"] - reached)
        if reached is not None and full is not None:
            uploading.append(full - reached)
            closing.append(closes[r]["closed_at"] - full)
    per_vol_s = {k: v / peers / window for k, v in sorted(volunteer.items())}
    billed = measured({"requests": dict(volunteer), "bytes_read": 0, "bytes_written": 0}, window, peers)
    # everything counted: the volunteers' requests and the scheduler's, shared among them
    shared = measured({"requests": dict(volunteer + mine), "bytes_read": 0, "bytes_written": 0}, window, peers)
    client = Counter()
    for h in hosts_out:
        for s in h["requests"]:
            client.update(s["requests"])
    return {"peers": peers, "target": target, "round_s_planned": round_s, "step_s": step_s,
            "window_s": round(window, 1), "rounds": max(at) - warmup,
            "s_per_round": window / (max(at) - warmup),
            "requests_per_volunteer_s": sum(per_vol_s.values()), "by_class_per_volunteer_s": per_vol_s,
            "scheduler_requests_s": sum(mine.values()) / window,
            "requests_per_volunteer_day_usd": {p: c.volunteer_day.total for p, c in billed.cost.items()},
            "with_scheduler_per_volunteer_day_usd": {p: c.volunteer_day.total for p, c in shared.cost.items()},
            "scheduler_by_class_s": {k: v / window for k, v in sorted(mine.items())},
            "close_latency_s": {"median": statistics.median(latency) if latency else None,
                                "worst": max(latency) if latency else None, "rounds": latency,
                                "uploading_median": statistics.median(uploading) if uploading else None,
                                "closing_median": statistics.median(closing) if closing else None},
            "client_counted_total": sum(client.values()), "server_counted_total": len(requests)}


def _reached(events: list[tuple[float, int]], target: int) -> float | None:
    """When samples arriving as (time, count), in time order, first add up to ``target``."""
    total = 0
    for t, n in events:
        total += n
        if total >= target:
            return t
    return None


def run(peers: tuple[int, ...] = (4, 16, 64), **kw) -> dict:
    return {"cases": [case(p, **kw) for p in peers]}


def table(res: dict):
    from rich.table import Table

    t = Table(title="7. coordination at scale: simulated volunteers on moto's S3 (requests counted by the server)",
              title_justify="left")
    for c in ("volunteers", "s/round", "req/s per volunteer", "get", "put", "head", "list",
              "scheduler req/s", "$/volunteer-day S3", "R2", "close after target: median s", "worst s",
              "of which uploading", "closing"):
        t.add_column(c, justify="right")
    for c in res["cases"]:
        k, lat, usd = c["by_class_per_volunteer_s"], c["close_latency_s"], c["requests_per_volunteer_day_usd"]
        t.add_row(str(c["peers"]), f"{c['s_per_round']:.1f}", f"{c['requests_per_volunteer_s']:.3f}",
                  *(f"{k.get(x, 0):.3f}" for x in ("get", "put", "head", "list")),
                  f"{c['scheduler_requests_s']:.2f}", f"{usd['s3']:.4f}", f"{usd['r2']:.4f}",
                  f"{lat['median']:.2f}" if lat["median"] is not None else "-",
                  f"{lat['worst']:.2f}" if lat["worst"] is not None else "-",
                  *(f"{lat[x]:.2f}" if lat.get(x) is not None else "-" for x in ("uploading_median", "closing_median")))
    return t


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(threadName)s %(name)s %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)
    role, *args = sys.argv[1:]
    if role == "scheduler":
        url, endpoint, name, until, out = args
        scheduler_main(url, endpoint, name, int(until), out)
    elif role == "volunteers":
        url, endpoint, name, names, step_s, until, out = args
        volunteers_main(url, endpoint, name, names.split(","), float(step_s), int(until), out)
    elif role == "idle":  # python -m benchmarks.coordination idle: 3 and 16 volunteers, 20 s and 100 s rounds
        print(json.dumps({"cases": [case(p, round_s=s, rounds=2) for s in (20.0, 100.0) for p in (3, 16)]}, indent=1))
    else:  # python -m benchmarks.coordination bench [peers ...]
        print(json.dumps(run(tuple(int(a) for a in args) or (4, 16, 64)), indent=1))
