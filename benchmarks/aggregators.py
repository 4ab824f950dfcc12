"""Benchmark 11: the organizer's bytes and requests per round with volunteer aggregators
(docs/aggregators.md), against the same collaboration with the organizer aggregating.

One process, moto's S3 server on loopback (server-side copies and ETags as S3 has them): a signed
run of the ``tiny`` model (int8 shards, AdamW, 8 chunks a part), three lock-step volunteers
computing and two aggregating, on one fake clock (the aggregators answer while the scheduler
waits). The scheduler, the workers and the aggregators each read and write through a Bucket of
their own, so each one's traffic is its own: requests counted where botocore sends them (what
the server bills: tests/test_requests.py), bytes as the Bucket and its zarr stores moved them.
Measured over the rounds after the first (which has no delta to read and no shards to prune).
With volunteers, twice: the organizer's audits recomputing every chunk of what they agree on (as
for aggregators that have not earned trust yet), and a share of them (``close.audit``: trusted
ones, the steady state), with the seconds the audits took the organizer.

``python -m benchmarks.aggregators [--rounds 4]`` prints a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from dedloc_pipeline.checks import audit
from dedloc_pipeline.organizer import referee
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import TINY, DrivenClock, small_config
from dedloc_pipeline.trust import identity
from dedloc_pipeline.volunteer.aggregator import AggregatorRole
from dedloc_pipeline.volunteer.worker import Worker

COMPUTING, AGGREGATING = ("a", "b", "c"), ("x", "y")
MODES = {"organizer": None, "volunteers": 10**9, "volunteers, sampled": 0}  # referee.TRUSTED_AFTER


def _timed(seconds: list) -> dict:
    """The audit functions, each adding the seconds it takes to ``seconds``; the originals."""
    originals = {n: getattr(audit, n) for n in ("screen", "sums", "answer")}
    for name, f in originals.items():
        def timed(*a, f=f, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                seconds.append(time.perf_counter() - t0)
        setattr(audit, name, timed)
    return originals


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collaboration(endpoint: str, name: str, volunteers: bool, rounds: int) -> dict:
    """A run to state ``rounds + 1``; each party's traffic over the rounds after the first, and
    the seconds of the organizer's audits."""
    work = tempfile.mkdtemp(prefix="agg-bench-")
    org = identity.generate(f"{work}/org.pem")
    keys = {n: identity.generate(f"{work}/{n}.pem") for n in COMPUTING + AGGREGATING}
    url = f"s3://agg-bench/{name}"
    cfg = small_config(name, **{**TINY, "chunk_size": 1 << 15}, codec="int8", chunks_per_part=8, target_batch_size=48,
                       organizer_key=identity.public(org), close={"aggregate_s": 60.0})
    run = init_run(Bucket(url, endpoint_url=endpoint), cfg, organizer=org)
    identity.update_roster(run.bucket, name, org, enroll={n: identity.public(k) for n, k in keys.items()},
                           aggregate=list(AGGREGATING))
    clock = DrivenClock(epoch=run.commit_of(0)["committed_at"])

    def party(organizer=None) -> Run:
        return Run(Bucket(url, endpoint_url=endpoint), name, organizer=organizer, clock=clock)
    organizer, computing, aggregating = party(org), party(), party()
    scheduler = Scheduler(organizer, parallel=2, poll_s=0, volunteers=volunteers)
    workers = [Worker(computing, n, micro_batch=8, threads=1, poll_s=0, signer=keys[n]) for n in COMPUTING]
    roles = [AggregatorRole(aggregating, n, keys[n]) for n in AGGREGATING]
    clock.parties += [r.step for r in roles]
    marks, t0, audits = {}, time.perf_counter(), []
    originals = _timed(audits)
    with ThreadPoolExecutor(2) as pool:
        for tick in range(10_000):
            if organizer.latest() >= rounds + 1:
                break
            for w in workers:
                w.step()
                w.flush()
            for role in roles:
                role.step()
            if tick % 2 == 0:
                scheduler.step(pool)
            if organizer.latest() not in marks:
                marks[organizer.latest()] = {p: b.bucket.stats.snapshot() for p, b in
                                             (("organizer", organizer), ("computing", computing),
                                              ("aggregating", aggregating))}
                marks[organizer.latest()]["audit_s"] = sum(audits)
    for name, f in originals.items():
        setattr(audit, name, f)
    for w in workers:
        w.leave()
    first, last = marks[1], marks[rounds + 1]
    per_round = {}
    for who in ("organizer", "computing", "aggregating"):
        a, b = first[who], last[who]
        per_round[who] = {"bytes_read": (b["bytes_read"] - a["bytes_read"]) / rounds,
                          "bytes_written": (b["bytes_written"] - a["bytes_written"]) / rounds,
                          "requests": {k: (b["requests"].get(k, 0) - a["requests"].get(k, 0)) / rounds
                                       for k in set(a["requests"]) | set(b["requests"])}}
    commit = organizer.commit_of(rounds + 1)
    return {"parameters": organizer.flat.n, "parts": organizer.n_parts, "shards_per_round": len(commit["shards"]),
            "aggregated_by": commit["aggregated_by"], "per_round": per_round,
            "audit_s": (last["audit_s"] - first["audit_s"]) / rounds,
            "seconds": time.perf_counter() - t0}


def run(rounds: int = 4) -> dict:
    """Both collaborations on one moto server; the organizer's bytes with volunteers over without."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        import boto3
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="agg-bench")
        out = {}
        for mode, trusted_after in MODES.items():
            referee.TRUSTED_AFTER, kept = trusted_after or 0, referee.TRUSTED_AFTER
            try:
                out[mode] = collaboration(endpoint, mode.replace(", ", "-"), trusted_after is not None, rounds)
            finally:
                referee.TRUSTED_AFTER = kept
    finally:
        server.terminate()
        server.wait(timeout=30)
    base = out["organizer"]["per_round"]["organizer"]
    out["organizer_ratio"] = {mode: {k: out[mode]["per_round"]["organizer"][k] / base[k]
                                     for k in ("bytes_read", "bytes_written")} for mode in MODES if mode != "organizer"}
    return out


def table(res: dict):
    from rich.table import Table

    o = res["organizer"]
    t = Table(title=f"11. volunteer aggregators: the tiny model ({o['parameters']:,} parameters, {o['parts']} parts), "
                    f"{o['shards_per_round']} shards a round, per round", title_justify="left")
    for c in ("aggregation", "who", "MB read", "MB written", "GET", "PUT", "LIST", "HEAD", "audits, s"):
        t.add_column(c, justify="left" if c in ("aggregation", "who") else "right")
    for mode in MODES:
        for who in ("organizer", "aggregating"):
            x = res[mode]["per_round"][who]
            q = x["requests"]
            t.add_row(mode, who if who == "organizer" else "both aggregators", f"{x['bytes_read'] / 1e6:.2f}",
                      f"{x['bytes_written'] / 1e6:.2f}",
                      *(f"{q.get(k, 0):.0f}" for k in ("get", "put", "list", "head")),
                      f"{res[mode]['audit_s']:.2f}" if who == "organizer" and mode != "organizer" else "")
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    print(json.dumps(run(p.parse_args().rounds), indent=1))


if __name__ == "__main__":
    main()
