"""A real collaboration on this machine, and the machine's limit beside it: what benchmarks 1 and 4
(benchmarks/throughput.py), 6 (shaped.py), 9 (local_steps.py) and the quality benchmark measure.

``collaborate`` runs the way volunteers do: one ``dedloc aggregate`` and N ``dedloc worker``
processes (one torch thread each) over a ``file://`` bucket. Throughput is the samples committed
between the end of the warm-up and the last commit, over the time between those commits. Each
worker's heartbeat carries its cumulative forward/backward seconds, wall seconds and bucket bytes,
read at both ends of the same window: compute fraction and bytes per round come from those.

Run on another bucket (``url``: an ``s3://`` one with its ``endpoint_url``) and with a command
prefix per process (``prefixes``: ``ip netns exec NS``), it is benchmark 6's collaboration on
shaped links (benchmarks/shaped.py).

``limit`` is the same training with no collaboration at all: one single-thread process per core,
each accumulating micro-batches and stepping its own AdamW every target batch; samples/s summed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dedloc_pipeline.protocol import heartbeat
from dedloc_pipeline.protocol.heartbeat import Heartbeat

from . import latency

DEDLOC = os.path.join(os.path.dirname(sys.executable), "dedloc")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _heartbeats(bucket, keys, peers: list[str]) -> dict[str, Heartbeat]:
    """Each peer's newest heartbeat, whatever round it was written for."""
    found: dict[str, Heartbeat] = {}
    written = {k: keys.written(k) for k in bucket.find(keys.volunteers_dir)}
    progress = [k for k, w in written.items() if w is not None and w.kind == "progress"]
    for raw in bucket.read_many(progress).values():
        hb = heartbeat.parse(raw)
        if hb is not None and hb.peer in peers and hb.time > (found[hb.peer].time if hb.peer in found else 0):
            found[hb.peer] = hb
    return found


def collaborate(peers: int = 4, micro_batch: int = 8, target: int = 256, codec: str = "int8", preset: str = "tiny",
                warmup: int = 2, rounds: int = 5, delayed: bool = True, poll: float | None = None,
                timeout_s: float = 600, worker_args: tuple[str, ...] = (), url: str | None = None,
                endpoint_url: str | None = None, env: dict | None = None,
                prefixes: dict[str, list[str]] | None = None, config: dict | None = None) -> dict:
    """``prefixes`` maps a process name (``scheduler``, ``peer-0``, ...) to what its command line
    starts with; ``env`` is added to every process's environment (S3 credentials); ``config``
    holds further RunConfig fields (a data set in ``url``'s bucket, the optimizer, ...)."""
    from dedloc_pipeline.protocol.config import recipe_config
    from dedloc_pipeline.protocol.run import init_run
    from dedloc_pipeline.storage.bucket import Bucket

    tmp = Path(tempfile.mkdtemp(prefix="dedloc-bench-"))
    url = url or f"file://{tmp}/bucket"
    endpoint = {"AWS_ENDPOINT_URL": endpoint_url, "AWS_ENDPOINT_URL_S3": endpoint_url} if endpoint_url else {}
    env = {**ENV, **(env or {}), **endpoint}
    prefixes = prefixes or {}
    cfg = recipe_config("bench", preset, target_batch_size=target, micro_batch=micro_batch, codec=codec,
                        delayed_updates=delayed, **(config or {}))
    run = init_run(Bucket(url, endpoint_url=endpoint_url), cfg)
    end = warmup + rounds
    names = [f"peer-{i}" for i in range(peers)]
    logs, procs = {}, {}
    common = ["--bucket", url, "--run", "bench", "--until-round", str(end),
              *(["--poll", str(poll)] if poll is not None else [])]  # None: the run's cadence, as users run
    for name in ["scheduler", *names]:
        logs[name] = open(tmp / f"{name}.log", "w")
        args = ["aggregate"] if name == "scheduler" else ["worker", "--peer-id", name, "--threads", "1",
                                                          *worker_args]
        procs[name] = subprocess.Popen([*prefixes.get(name, []), DEDLOC, *args, *common], env=env,
                                       stdout=logs[name], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    bucket = Bucket(url, endpoint_url=endpoint_url)  # the harness's own reads are not counted against the peers
    handles = {n: psutil.Process(p.pid) for n, p in procs.items()}
    deadline = time.monotonic() + timeout_s
    stop_cpu: dict = {}
    recorder, observed = latency.Recorder(bucket, run.keys, names), 0.0
    try:
        start = None
        while True:
            if time.monotonic() - observed >= 1.0:  # each heartbeat holds a volunteer's last 4 states
                recorder.observe()
                observed = time.monotonic()
            if start is None and bucket.exists(run.keys.commit(warmup)):
                start = _heartbeats(bucket, run.keys, names)
                cpu0 = {n: _cpu(h) for n, h in handles.items()}
            if start is not None and not stop_cpu and bucket.exists(run.keys.commit(end)):
                stop_cpu = {n: _cpu(h) for n, h in handles.items()}
            if all(p.poll() is not None for p in procs.values()):
                break
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs.values()):
                raise RuntimeError("collaboration failed or timed out:\n" + _tails(tmp, procs))
            time.sleep(0.2)
        stop = _heartbeats(bucket, run.keys, names)
        recorder.observe()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    commits = [run.commit_of(s) for s in range(warmup, end + 1)]
    span = commits[-1]["committed_at"] - commits[0]["committed_at"]
    samples = sum(c["samples"] for c in commits[1:])
    n = run.flat.n
    totals = ("compute_s", "wall_s", "bytes_up", "bytes_down")
    window = {p: {k: getattr(stop[p], k) - getattr(start[p], k) for k in totals}
              for p in names if p in start and p in stop}
    return {
        "system": "dedloc-pipeline", "preset": preset, "peers": peers, "micro_batch": micro_batch, "target": target,
        "codec": codec, "delayed_updates": delayed, "rounds": rounds, "n_params": n,
        "samples_per_s": samples / span, "s_per_round": span / rounds,
        "compute_fraction": sum(w["compute_s"] / w["wall_s"] for w in window.values()) / len(window),
        "up_bytes_per_param": sum(w["bytes_up"] for w in window.values()) / len(window) / rounds / n,
        "down_bytes_per_param": sum(w["bytes_down"] for w in window.values()) / len(window) / rounds / n,
        "stale_fraction": sum(s["stale_samples"] for c in commits[1:] for s in _shards(run, c)) / samples,
        # rounds warmup..end-1 (their states are commits[1:]), stage by stage
        "latency": recorder.budget(run, warmup, end - 1),
        # one target batch a round, as hivemind counts its own (in samples: target x rounds per second)
        "samples_per_s_target": rounds * target / span,
        "counted_fraction": _counted_fraction(run, warmup, end),
        # where the machine's CPU went in the window: share of (cores x window) per role
        "cpu_share": {"scheduler": (stop_cpu["scheduler"] - cpu0["scheduler"]) / span / os.cpu_count(),
                      "workers": sum(stop_cpu[p] - cpu0[p] for p in names) / span / os.cpu_count()},
    }


def _cpu(proc) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:  # exited right at the end: its last reading is lost
        return float("nan")


def _counted_fraction(run, first: int, end: int) -> float:
    """Of the samples the workers computed for rounds ``first`` to ``end - 1``, the share those
    rounds counted. A worker's stream runs on without gaps, so what it computed is the span of
    its stream from its end before round ``first`` (anything any CLOSE named) to the end of what
    those rounds counted; the gaps are samples thrown away (shards rejected or late, samples
    dropped as too stale)."""
    before: dict[str, int] = {}
    counted: dict[str, list[tuple[int, int]]] = {}
    for r in range(end):
        close = run.bucket.read_json(run.keys.close(r))
        # a CLOSE's ``missed`` are the round before's shards: spent there
        for entry, of in [(e, r) for e in close["accepted"] + close["rejected"]] + \
                [(e, r - 1) for e in close.get("missed", [])]:
            ranges = (entry.get("data") or {}).get("ranges", [])
            peer = entry.get("peer") or (entry.get("data") or {}).get("stream")
            if of < first:
                before[peer] = max([before.get(peer, 0), *(a + c for a, c in ranges)])
            elif entry in close["accepted"]:
                counted.setdefault(peer, []).extend(ranges)
    spans = sum(max(a + c for a, c in rs) - before.get(p, 0) for p, rs in counted.items())
    return sum(c for rs in counted.values() for _, c in rs) / spans


def _shards(run, commit: dict) -> list[dict]:
    """Stale-sample counts live in the round's CLOSE (kept forever, like COMMIT)."""
    close = run.bucket.read_json(run.keys.close(commit["round"]))
    return close["accepted"]


def _tails(tmp: Path, procs: dict) -> str:
    return "\n".join(f"--- {n} (exit {p.poll()}) ---\n{(tmp / f'{n}.log').read_text()[-2000:]}"
                     for n, p in procs.items())


def _train_alone(micro_batch: int, target: int, seconds: float, warmup_s: float, preset: str = "tiny",
                 seq_len: int = 128) -> float:
    """One process, one thread, no collaboration: samples/s over ``seconds`` after a warm-up."""
    import torch

    from dedloc_pipeline.model.albert import build_model, pretraining_loss_sum
    from dedloc_pipeline.model.data import SyntheticSource

    torch.set_num_threads(1)
    model = build_model(preset, 0, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    src = SyntheticSource(model.config.vocab_size, seq_len, seed=0)
    cursor, counted, t_start = 0, 0, None
    t0 = time.monotonic()
    while True:
        now = time.monotonic()
        if t_start is None and now - t0 >= warmup_s:
            t_start, counted = now, 0
        if t_start is not None and now - t_start >= seconds:
            return counted / (now - t_start)
        loss = pretraining_loss_sum(model, src.batch("alone", cursor, micro_batch))
        loss.backward()
        cursor += micro_batch
        counted += micro_batch
        if cursor % target == 0:
            for p in model.parameters():
                if p.grad is not None:  # the sentence-order head has none on synthetic data
                    p.grad /= target
            opt.step()
            opt.zero_grad()


def limit(micro_batch: int = 8, target: int = 256, seconds: float = 30.0, warmup_s: float = 8.0,
          processes: int | None = None, preset: str = "tiny", seq_len: int = 128) -> dict:
    processes = processes or os.cpu_count()
    cmd = [sys.executable, "-m", "benchmarks.collab", "alone", str(micro_batch), str(target), str(seconds),
           str(warmup_s), preset, str(seq_len)]
    procs = [subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    rates = [float(p.communicate(timeout=seconds + warmup_s + 120)[0].strip().splitlines()[-1]) for p in procs]
    return {"system": "no collaboration", "processes": processes, "micro_batch": micro_batch, "preset": preset,
            "seq_len": seq_len, "samples_per_s": sum(rates), "per_process": rates}


if __name__ == "__main__":
    if sys.argv[1:2] == ["alone"]:
        mb, tgt, secs, wu, preset, seq = sys.argv[2:8]
        print(_train_alone(int(mb), int(tgt), float(secs), float(wu), preset, int(seq)))
    else:
        print(json.dumps({"ours": collaborate(), "limit": limit()}, indent=1))
