"""End to end: the real `dedloc` command line, each role its own OS process, over a real bucket.

One smoke case, on S3 (moto's server): the processes, their command lines and the bucket are
what is tested, so nothing here depends on how fast they run. A local folder's multi-process
case is `make pretrain`'s (tests/test_deployment.py): worker processes on a file bucket.
What depends on time (a peer's timeout, a killed worker, a late joiner, a stale view, the close
timeout) is tested on the fake clock in one process (tests/test_timing.py), and what the rounds
learn by the equivalence and hostile tests. Every process imports torch (seconds of start-up on
a small machine), so each case starts few of them and bounds them with ``--until-round``; every
wait polls the bucket against a deadline and fails with the processes' logs. Whatever is still
running at the end of a case is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.protocol.run import Run, RunError
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import assert_counted_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEDLOC = os.path.join(os.path.dirname(sys.executable), "dedloc")
RUN = "e2e"
TARGET = 48
INIT = ["--preset", "micro", "--seq-len", "32", "--chunk-size", "40960", "--target-batch", str(TARGET),
        "--micro-batch", "4", "--lr", "0.002", "--warmup-steps", "0"]
WAIT = 480.0  # a safety bound on any one wait (a process start imports torch: a minute under load)


class Cluster:
    """The processes of one collaboration, their logs, and deadline-bounded waits on the bucket."""

    def __init__(self, tmp_path: Path, url: str, poll: float = 0.3):
        self.tmp, self.url, self.poll = tmp_path, url, str(poll)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.procs: dict[str, subprocess.Popen] = {}
        self._files = []
        self.run: Run | None = None

    # processes
    def dedloc(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """A short command (init, status), run to completion."""
        res = subprocess.run([DEDLOC, *args, "--bucket", self.url, "--run", RUN], env=self.env,
                             capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            self.fail(f"`dedloc {' '.join(args)}` exited {res.returncode}:\n{res.stdout}{res.stderr}")
        return res

    def cli(self, *args: str):
        """A short command (init, status) in this process: the same code, no torch start-up."""
        res = CliRunner().invoke(app, [*args, "--bucket", self.url, "--run", RUN], env=self.env)
        if res.exit_code != 0:
            self.fail(f"`dedloc {' '.join(args)}` exited {res.exit_code}:\n{res.output}")
        return res

    def init(self, *extra: str) -> Run:
        self.cli("init", *INIT, *extra)
        self.run = Run(Bucket(self.url), RUN)
        assert self.run.latest() == 0
        return self.run

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        self._files.append(log)
        p = subprocess.Popen([DEDLOC, *args, "--bucket", self.url, "--run", RUN], env=self.env,
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = p
        return p

    def worker(self, peer: str, until: int | None, *extra: str) -> subprocess.Popen:
        args = ["worker", "--peer-id", peer, "--threads", "1", "--poll", self.poll, *extra]
        return self.start(peer, *args, *(["--until-round", str(until)] if until is not None else []))

    def scheduler(self, until: int | None) -> subprocess.Popen:
        args = ["aggregate", "--poll", self.poll]
        return self.start("scheduler", *args, *(["--until-round", str(until)] if until is not None else []))

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for f in self._files:
            f.close()

    # diagnostics
    def logs(self) -> str:
        out = []
        for name, p in self.procs.items():
            for f in self._files:
                f.flush()
            text = (self.tmp / f"{name}.log").read_text(errors="replace")
            out.append(f"----- {name} (exit {p.poll()}) -----\n{text[-6000:]}")
        return "\n".join(out)

    def fail(self, msg: str):
        pytest.fail(f"{msg}\n{self.logs()}", pytrace=False)

    # waiting
    def latest(self) -> int:
        try:
            return self.run.latest()
        except RunError:
            return -1

    def wait_exit(self, names, timeout: float = WAIT) -> None:
        """Every named process exits by itself, with status 0."""
        deadline = time.monotonic() + timeout
        for n in names:
            try:
                self.procs[n].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"{n} still running after {timeout:.0f}s (state {self.latest()})")
            if self.procs[n].returncode != 0:
                self.fail(f"{n} exited {self.procs[n].returncode}")

    def commits(self) -> list[dict]:
        """COMMIT of every state after 0, in order."""
        return [self.run.commit_of(s) for s in range(1, self.run.latest() + 1)]


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(url: str, **kw) -> Cluster:
        c = Cluster(tmp_path, url, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def collaborate(c: Cluster, rounds: int, *init: str, status_process: bool = False) -> dict:
    """Three workers and the scheduler until state ``rounds``; `dedloc status --json` after
    (in its own process too if ``status_process``). Late shards are folded into the next round:
    rounds this small often close on one peer's carried samples alone, and a peer slowed by the
    machine's load could otherwise see every shard it sends arrive after its round closed."""
    c.init("--late-shards", "fold", *init)
    c.scheduler(rounds)
    peers = ["w0", "w1", "w2"]
    for p in peers:
        c.worker(p, rounds)
    c.wait_exit(["scheduler", *peers])
    for p in peers:
        assert f"stopped at state {rounds}" in (c.tmp / f"{p}.log").read_text(), c.logs()
    status = c.dedloc if status_process else c.cli
    return json.loads(status("status", "--json").stdout)


def check_history(c: Cluster, s: dict, rounds: int) -> None:
    assert s["run"] == RUN and s["round"] == rounds, s
    history = s["history"]
    assert [h["round"] for h in history] == list(range(rounds)), history
    for h, commit in zip(history, c.commits()):
        assert h["samples"] >= TARGET, h
        assert h["contributors"] and set(h["contributors"]) <= {"w0", "w1", "w2"}, h
        assert h["samples"] == commit["samples"] and h["contributors"] == commit["contributors"]
        assert h["loss"] == pytest.approx(commit["loss"])
    assert {p for h in history for p in h["contributors"]} == {"w0", "w1", "w2"}, history
    assert sum(p["samples"] for p in s["peers"]) == sum(h["samples"] for h in history)
    assert_counted_once(c.run)


def test_three_workers_on_s3(cluster, s3_bucket):
    """Against a real S3 protocol server (moto on loopback); credentials and endpoint reach the
    processes through the usual AWS variables (set by the s3_bucket fixture)."""
    assert os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://127.0.0.1:")
    rounds = 3
    c = cluster(s3_bucket.url)
    s = collaborate(c, rounds, status_process=True)
    check_history(c, s, rounds)
    # it really went through S3: the COMMITs are objects in that bucket
    assert s3_bucket.exists(f"runs/{RUN}/state/{rounds:08d}/COMMIT.json")


def test_volunteers_come_and_go_on_a_file_bucket(cluster, tmp_path):
    """Deliverable of the liveness rule with real processes (the fake-clock cases are in
    tests/test_liveness.py): alice and bob train, both leave with SIGTERM (as systemd stops
    them), then carol joins alone and fills every round after by herself; nothing counts twice.
    A round may still close on a shard of theirs sent as they left (computed ahead, it filled
    the round at once): carol's rounds are those after the last they contributed to."""
    import signal
    c = cluster(f"file://{tmp_path}/bucket")
    c.init("--peer-timeout", "6")
    rounds = 5
    c.scheduler(rounds)
    for p in ("alice", "bob"):
        c.worker(p, None)
    deadline = time.monotonic() + WAIT
    while c.latest() < 2:
        if time.monotonic() > deadline or any(c.procs[n].poll() is not None for n in ("scheduler", "alice", "bob")):
            c.fail(f"state 2 not reached (state {c.latest()})")
        time.sleep(0.2)  # real processes' progress: nothing to drive
    for p in ("alice", "bob"):
        c.procs[p].send_signal(signal.SIGTERM)
    for p in ("alice", "bob"):
        c.procs[p].wait(120)
        assert c.procs[p].returncode == 143, c.logs()
        assert "stopped cleanly after SIGTERM" in (c.tmp / f"{p}.log").read_text(), c.logs()
    left_at = c.latest()
    c.worker("carol", rounds)
    c.wait_exit(["scheduler", "carol"])
    assert f"stopped at state {rounds}" in (c.tmp / "carol.log").read_text(), c.logs()
    commits = c.commits()
    theirs = max(k["round"] for k in commits if {"alice", "bob"} & set(k["contributors"]))
    alone = [k for k in commits if k["round"] > theirs]
    assert theirs <= left_at and len(alone) >= rounds - left_at - 1, c.logs()
    assert all(k["contributors"] == ["carol"] for k in alone), c.logs()
    assert all(commit["samples"] >= TARGET for commit in alone)
    assert_counted_once(c.run)
