"""End to end: the real `dedloc` command line, each role its own OS process, over a real bucket.

Every process imports torch (seconds of start-up on a small machine), so each case starts few
of them and bounds them with ``--until-round``; every wait polls the bucket against a deadline and
fails with the processes' logs. Whatever is still running at the end of a case is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.protocol.run import Run, RunError
from dedloc_pipeline.storage.bucket import Bucket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DEDLOC = os.path.join(os.path.dirname(sys.executable), "dedloc")
RUN = "e2e"
TARGET = 48
PEER_TIMEOUT = 4.0
INIT = ["--seq-len", "32", "--chunk-size", "262144", "--target-batch", str(TARGET), "--micro-batch", "4",
        "--peer-timeout", str(PEER_TIMEOUT), "--lr", "0.002", "--warmup-steps", "0"]
WAIT = 180.0  # seconds any one wait may take before the case fails


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

    def interrupt(self, grace: float = 20.0) -> None:
        """Ctrl-C for everyone still running (workers leave cleanly), then kill what lingers."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

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

    def wait_for(self, pred, what: str, timeout: float = WAIT, alive: tuple[str, ...] = (), every: float = 0.2):
        """Poll ``pred`` until it returns something truthy; fail early if a process in ``alive``
        exits, and with every log on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            dead = [n for n in alive if self.procs[n].poll() is not None]
            if dead:
                self.fail(f"while waiting for {what}: {dead} exited (state {self.latest()})")
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout:.0f}s waiting for {what} (state {self.latest()})")
            time.sleep(every)

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


def test_three_workers_on_a_local_bucket(cluster, tmp_path):
    rounds = 5
    c = cluster(f"file://{tmp_path}/bucket")
    s = collaborate(c, rounds, status_process=True)
    check_history(c, s, rounds)
    first, last = s["history"][0]["loss"], s["history"][-1]["loss"]
    assert last < first - 0.1, [h["loss"] for h in s["history"]]


def test_three_workers_on_s3(cluster, s3_bucket):
    """The same against a real S3 protocol server (moto on loopback); credentials and endpoint
    reach the processes through the usual AWS variables (set by the s3_bucket fixture)."""
    assert os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://127.0.0.1:")
    rounds = 5  # fewer are too few for the loss to fall reliably under load (a step is mostly noise)
    c = cluster(s3_bucket.url)
    s = collaborate(c, rounds)
    check_history(c, s, rounds)
    assert s["history"][-1]["loss"] < s["history"][0]["loss"], [h["loss"] for h in s["history"]]
    # it really went through S3: the COMMITs are objects in that bucket
    assert s3_bucket.exists(f"runs/{RUN}/state/{rounds:08d}/COMMIT.json")


# diloco: a worker takes an inner step every 8 samples (2 micro-batches; the victim's: every one)
ALGORITHMS = {"dedloc": (), "diloco": ("--algorithm", "diloco", "--inner-batch", "8")}


def assert_counted_once(run: Run) -> None:
    """No sample of any stream counts in two accepted shards, over every committed round."""
    seen: set[tuple[str, int]] = set()
    for r in range(run.latest()):
        for s in run.bucket.read_json(run.keys.close(r))["accepted"]:
            got = {(s["data"]["stream"], i) for a, n in s["data"]["ranges"] for i in range(a, a + n)}
            assert not got & seen, f"round {r}: {s['key']} counts samples already counted"
            seen |= got


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_killed_worker_does_not_stop_the_run(cluster, tmp_path, algorithm):
    """SIGKILL a worker while it holds samples of the open round (in diloco: in the middle of its
    inner steps): its heartbeat goes stale after --peer-timeout, the others make its samples
    up, and the rounds keep closing without it."""
    bound = 30  # a safety bound only: the case stops everyone once two rounds closed after the kill
    c = cluster(f"file://{tmp_path}/bucket")
    # Without delayed updates every round starts from empty accumulators, so the victim's pending
    # share (large: bigger micro-batches) really is missing from the round it dies in.
    run = c.init("--no-delayed-updates", *ALGORITHMS[algorithm])
    c.scheduler(bound)
    c.worker("w0", bound)
    c.worker("w1", bound)
    c.worker("victim", bound, "--micro-batch", "16")

    def victim_busy():
        r = c.latest()
        if r < 1:
            return None
        p = run.bucket.read_json(run.keys.progress(r, "victim"))
        held = p.get("samples", 0) - p.get("sending", 0) if p else 0  # computed, not being uploaded
        if p and p.get("round") == r and held >= 16 and time.time() - p["time"] < 2:
            return r, p
        return None

    r_kill, progress = c.wait_for(victim_busy, "the victim to hold samples of an open round after state 1",
                                  alive=("scheduler", "w0", "w1", "victim"), every=0.05)
    c.procs["victim"].send_signal(signal.SIGKILL)
    c.procs["victim"].wait(10)
    killed_at = time.time()
    assert c.procs["victim"].returncode == -signal.SIGKILL
    # every shard the victim ever finished, listed before anything could be pruned
    before = {run.keys.shard_of(k) for r in range(r_kill + 2)
              for k in run.bucket.find(f"{run.keys.manifests_dir(r)}/victim")}

    # the round open at the kill, then two opened after it
    c.wait_for(lambda: c.latest() >= r_kill + 4, f"state {r_kill + 4}", alive=("scheduler", "w0", "w1"))
    c.interrupt()
    commits = c.commits()
    for commit in commits:
        assert commit["samples"] >= TARGET and commit["contributors"], commit
    # nothing of the victim's counts but what it had uploaded before it died
    assert {s["key"] for x in commits for s in x["shards"] if s["peer"] == "victim"} <= before
    # the round open at the kill closed too, though the victim's pending samples never came
    open_then = commits[r_kill]
    assert open_then["round"] == r_kill and open_then["samples"] >= TARGET
    assert {"w0", "w1"} & set(open_then["contributors"]), open_then
    # rounds opened after the kill (state r committed after it) close from the survivors alone
    after = [commits[r] for r in range(r_kill + 1, len(commits)) if run.commit_of(r)["committed_at"] > killed_at]
    assert len(after) >= 2, [(x["round"], x["committed_at"]) for x in commits]
    for commit in after:
        assert set(commit["contributors"]) <= {"w0", "w1"}, commit
    assert_counted_once(run)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_worker_joining_late_pulls_the_state_and_contributes(cluster, tmp_path, algorithm):
    """In diloco the joiner starts with a fresh inner optimizer on the state it pulled."""
    c = cluster(f"file://{tmp_path}/bucket")
    c.init(*ALGORITHMS[algorithm])
    bound = 40  # a safety bound only: the case stops everyone once the joiner has contributed
    c.scheduler(bound)
    c.worker("w0", bound)
    c.worker("w1", bound)
    joined_at = c.wait_for(lambda: (r := c.latest()) >= 2 and r, "state 2",
                           alive=("scheduler", "w0", "w1"))
    c.worker("joiner", None)

    def joiner_counted():
        return [x for x in c.commits() if "joiner" in x["contributors"]]

    counted = c.wait_for(joiner_counted, "a round with the joiner among its contributors",
                         alive=("scheduler", "w0", "w1", "joiner"), every=0.5)
    c.interrupt()
    # it computed on the state it pulled (shards go to the round of the worker's state): >= 2
    assert min(x["round"] for x in counted) >= joined_at >= 2
    for x in counted:
        shards = [s for s in x["shards"] if s["peer"] == "joiner"]
        assert shards and all(f"/rounds/{x['round']:08d}/shards/joiner/" in s["key"] for s in shards)
        assert x["samples"] >= TARGET
    # nothing of the joiner's before it joined
    assert all("joiner" not in x["contributors"] for x in c.commits()[:joined_at])
    # and the established workers kept contributing alongside it
    assert {p for x in c.commits() for p in x["contributors"]} >= {"w0", "w1", "joiner"}
    assert_counted_once(c.run)
