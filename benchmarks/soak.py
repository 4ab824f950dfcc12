"""Soak: hundreds of rounds of a small run with churn, in one process; memory, open files and the
bucket must stay bounded, and nothing may be lost (docs/soak.md).

A scheduler and a changing set of ``Worker``s (poll 0, one torch thread) run in lock-step against
a ``file://`` bucket in a temporary folder, as ``dedloc_pipeline/testing.py`` does: every live worker
takes one step, and every second such step the scheduler takes one. Churn follows a fixed seeded
schedule, once per cycle of ``every`` rounds (offsets within the cycle):

    1  leave    a live peer calls ``leave()`` and is dropped
    3  join     a peer with a new id joins
    5  restart  a live peer leaves and a new Worker with the same id starts at once (a process restart)
    7  return   a departed peer id comes back after rounds away (a new Worker, same id)
    9  leave    another live peer leaves

so the population is the same at the start of every cycle. After every ``sample_every``-th commit
the process samples its RSS (``VmRSS``), open file descriptors, threads, the bucket's bytes and
files (``os.walk``; split into the ledger, the kept checkpoints and the rest, the working set), the
wall time and the committed loss. At the end it checks that every state 0..rounds has a COMMIT
and every round a CLOSE, that each COMMIT counts its CLOSE's samples and no shard was rejected
(every peer is honest), that no sample index of any peer's stream is counted twice across the
accepted shards of all CLOSEs and restarted or returning peers resume after what they uploaded,
that pruning left only the checkpoints, that the loss fell, that fds and threads are constant
after warm-up and that the working set did not grow; it reports the slope of RSS over the second
half (``--trim`` adds RSS after ``malloc_trim``, a diagnostic).

``python -m benchmarks.soak --rounds 300 --out .dedloc/bench/soak.json`` prints a table, writes the
results and, if matplotlib is importable, ``soak.png`` next to them (the checks, the verdicts, the
table and the plot: benchmarks/soak_verdict.py). ``--faults`` runs the soak with faults instead
(benchmarks/soak_faults.py): the same run on the fake clock with random churn, killed schedulers and
aggregators, a full disk and a failing bucket, judged by the ledger and a one-process replay.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import soak_verdict

EVENTS = {1: "leave", 3: "join", 5: "restart", 7: "return", 9: "leave"}  # offset in a cycle (>= 10 rounds)


def soak_config(run: str = "soak", preset: str = "tiny", **kw):
    """The tests' small config (``dedloc_pipeline.testing``) on ``preset`` (docs/soak.md's figures:
    tiny, TINY's chunks; the test's: micro), with int8 shards, delayed updates and pruning as in
    production."""
    from dedloc_pipeline.testing import TINY, small_config

    cut = TINY if preset == "tiny" else {"preset": preset}  # others in small_config's chunks
    return small_config(run, **dict(cut, codec="int8", delayed_updates=True, keep_states=3, checkpoint_every=50,
                                    **kw))


def schedule(rounds: int, every: int = 10) -> dict[int, str]:
    """Churn events by the state after whose commit they happen."""
    return {s: EVENTS[s % every] for s in range(1, rounds) if s % every in EVENTS}


# process figures
def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def bucket_usage(root: str, run_root: str, latest: int, keep_states: int, checkpoint_every: int) -> dict:
    """Bytes and files under the bucket: the ledger (COMMIT, CLOSE, run.json, LATEST), the
    checkpoints kept forever (params and optimizer of every ``checkpoint_every``-th state older
    than the kept window), and the rest: the working set pruning must keep bounded."""
    usage = {k: 0 for k in ("bytes", "files", "ledger_bytes", "ledger_files", "checkpoint_bytes",
                            "checkpoint_files", "working_bytes", "working_files")}
    states = os.path.join(root, run_root, "state")
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            if name in ("COMMIT.json", "CLOSE.json", "run.json", "LATEST.json"):
                kind = "ledger"
            else:
                kind = "working"
                rel = os.path.relpath(path, states)
                if not rel.startswith(".."):
                    head = rel.split(os.sep, 1)[0]
                    if head.isdigit():
                        s = int(head)
                        if s % checkpoint_every == 0 and s <= latest - keep_states:
                            kind = "checkpoint"
            usage["bytes"] += size
            usage["files"] += 1
            usage[f"{kind}_bytes"] += size
            usage[f"{kind}_files"] += 1
    return usage


# the run
def soak(rounds: int = 300, sample_every: int = 1, seed: int = 0, peers: int = 3, every: int = 10,
         bucket_dir: str | None = None, keep_bucket: bool = False, trim: bool = False, preset: str = "tiny",
         log=print) -> dict:
    """Run ``rounds`` rounds with churn and return the samples, the events and the verdicts.

    ``trim``: a diagnostic. After each RSS sample, ``malloc_trim(0)`` hands glibc's free heap
    back to the system and RSS is read again (``rss_trimmed_mb``): growth that survives it is
    memory still in use, not the allocator's retention."""
    import torch

    from dedloc_pipeline.organizer.scheduler import Scheduler
    from dedloc_pipeline.protocol.run import init_run
    from dedloc_pipeline.storage.bucket import Bucket
    from dedloc_pipeline.volunteer.worker import Worker

    torch.set_num_threads(1)
    code = _code_version()  # what this process imported, whatever is committed meanwhile
    tmp = bucket_dir or tempfile.mkdtemp(prefix="dedloc-soak-")
    root = os.path.join(tmp, "bucket")
    cfg = soak_config(preset=preset)
    run = init_run(Bucket(f"file://{root}"), cfg)
    rng = random.Random(seed)
    events_at = schedule(rounds, every)

    def worker(peer: str) -> Worker:
        return Worker(run, peer, micro_batch=cfg.micro_batch, threads=1, poll_s=0)

    def ledger_end(peer: str, upto: int, since: int = 0) -> int:
        """Where the peer's uploaded stream ends, by the CLOSEs of rounds ``since`` .. ``upto`` - 1."""
        end = 0
        for r in range(since, upto):
            for s in (run.bucket.read_json(run.keys.close(r)) or {}).get("accepted", []):
                if s["peer"] == peer:
                    end = max([end] + [a + n for a, n in s["data"]["ranges"]])
        return end

    live: dict[str, Worker] = {}
    departed: dict[str, int] = {}  # peer -> state at which it left
    born: dict[str, int] = {}  # peer -> state at which its current Worker started
    next_id = 0
    for _ in range(peers):
        live[f"p{next_id:03d}"], born[f"p{next_id:03d}"] = worker(f"p{next_id:03d}"), 0
        next_id += 1
    events: list[dict] = []

    def start(peer: str, kind: str, state: int) -> None:
        w = live[peer] = worker(peer)
        w.sync()  # where its stream resumes: after what its earlier incarnations uploaded
        ev = {"state": state, "event": kind, "peer": peer, "resumes_at": w.cursor}
        if kind in ("restart", "return"):
            ev["ledger_end"] = ledger_end(peer, state)  # over all its incarnations
            ev["away_rounds"] = state - departed.pop(peer, state)
        if kind == "restart":  # what the Worker it replaces uploaded
            ev["incarnation_end"] = ledger_end(peer, state, since=born[peer])
        born[peer] = state
        events.append(ev)

    def churn(state: int) -> None:
        nonlocal next_id
        kind = events_at.get(state)
        if kind == "leave" and len(live) > 1:
            peer = rng.choice(sorted(live))
            live.pop(peer).leave()
            departed[peer] = state
            events.append({"state": state, "event": "leave", "peer": peer})
        elif kind == "join" or (kind == "return" and not departed):
            peer = f"p{next_id:03d}"
            next_id += 1
            start(peer, "join", state)
        elif kind == "restart" and live:
            peer = rng.choice(sorted(live))
            live.pop(peer).leave()
            departed[peer] = state
            start(peer, "restart", state)
        elif kind == "return":
            start(rng.choice(sorted(departed)), "return", state)

    samples: list[dict] = []
    round_s: list[float] = []
    losses: dict[int, float] = {}

    def sample(state: int, t: float) -> None:
        usage = bucket_usage(root, run.keys.root, state, cfg.keep_states, cfg.checkpoint_every)
        samples.append({"state": state, "t": round(t, 2), "rss_mb": round(rss_mb(), 1), "fds": open_fds(),
                        # each live worker owns one transfer thread: counted apart, bounded by the peers
                        "threads": sum("-transfers" not in t.name for t in threading.enumerate()),
                        "transfer_threads": sum("-transfers" in t.name for t in threading.enumerate()),
                        "py_objects": len(gc.get_objects()),
                        "peers": len(live),
                        "loss": losses.get(state), **usage})
        if trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            samples[-1]["rss_trimmed_mb"] = round(rss_mb(), 1)

    sched = Scheduler(run, parallel=2, poll_s=0)
    t0 = time.monotonic()
    sample(0, 0.0)
    state, steps, last_commit = 0, -1, t0  # the scheduler steps on the first iteration, then every second
    try:
        with ThreadPoolExecutor(2) as pool:
            while state < rounds:  # lock-step, as dedloc_pipeline/testing.py
                for w in list(live.values()):
                    w.step()
                    w.flush()
                steps += 1
                if steps > 400:  # a round fills in a handful of steps
                    raise RuntimeError(f"state {state + 1} not committed in {steps} steps")
                if steps % 2 or not sched.step(pool):
                    continue
                state, steps, now = state + 1, 0, time.monotonic()
                round_s.append(now - last_commit)
                last_commit = now
                losses[state] = run.commit_of(state)["loss"]
                churn(state)
                if state % sample_every == 0 or state == rounds:
                    sample(state, now - t0)
                if log and state % max(1, rounds // 10) == 0:
                    s = samples[-1]
                    log(f"state {state}/{rounds}: {now - t0:.0f} s, loss {losses[state]:.3f}, "
                        f"RSS {s['rss_mb']:.0f} MB, fds {s['fds']}, threads {s['threads']}, "
                        f"bucket {s['bytes'] / 2**20:.1f} MiB in {s['files']} files, {len(live)} peers")
            wall = time.monotonic() - t0
            for w in live.values():
                w.leave()
        checks = soak_verdict.verify(run, rounds, cfg)
    finally:
        if not keep_bucket and bucket_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    res = soak_verdict.summarize(samples, round_s, wall, rounds, checks, events, cfg)
    res["config"] = cfg.model_dump(mode="json")
    res["code"] = code
    res["settings"] = {"rounds": rounds, "sample_every": sample_every, "seed": seed, "peers": peers,
                       "every": every, "trim": trim, "events": {str(k): v for k, v in EVENTS.items()}}
    if keep_bucket or bucket_dir is not None:
        res["bucket"] = root
    return res


def _code_version() -> dict:
    """The commit measured, and whether dedloc_pipeline/ differed from it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "dedloc_pipeline"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--sample-every", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="default .dedloc/bench/soak.json (--faults: soak-faults.json)")
    ap.add_argument("--keep-bucket", action="store_true")
    ap.add_argument("--preset", default="tiny", help="the model (docs/soak.md's figures: tiny)")
    ap.add_argument("--trim", action="store_true", help="diagnostic: malloc_trim(0) after each RSS sample")
    ap.add_argument("--faults", action="store_true", help="the soak with faults (benchmarks/soak_faults.py)")
    args = ap.parse_args(argv)
    from rich.console import Console

    if args.faults:
        return _with_faults(args, args.out or Path(".dedloc/bench/soak-faults.json"))
    args.out = args.out or Path(".dedloc/bench/soak.json")
    res = soak(args.rounds, sample_every=args.sample_every, seed=args.seed, keep_bucket=args.keep_bucket,
               trim=args.trim, preset=args.preset)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    Console().print(soak_verdict.table(res))
    if soak_verdict.plot(res, args.out.with_suffix(".png")):
        print(f"plot: {args.out.with_suffix('.png')}")
    print(f"results: {args.out}" + ("" if res["ok"] else "  (some checks FAILED)"))
    return 0 if res["ok"] else 1


def _with_faults(args, out: Path) -> int:
    from rich.console import Console

    from . import soak_faults

    tmp = tempfile.mkdtemp(prefix="dedloc-soak-faults-")
    try:
        res = soak_faults.soak(soak_config(preset=args.preset), args.rounds, f"file://{tmp}/bucket", args.seed)
    finally:
        if not args.keep_bucket:
            shutil.rmtree(tmp, ignore_errors=True)
    res["code"], res["preset"] = _code_version(), args.preset
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    Console().print(soak_verdict.faults_table(res))
    print(f"results: {out}" + ("" if res["ok"] else "  (some checks FAILED)"))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
