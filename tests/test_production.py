"""The organizer's production path on a real local Prefect server: `prefect.yaml` deployed with
`prefect deploy --all` to a process work pool, `prefect worker start` running the flow runs, and
aggregation on two Prefect task workers (flows/aggregators.py), each with its own PREFECT_HOME as
on another machine: they share only the API and a task-storage block with the organizer."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket

from .conftest import _free_port
from .test_flows import CONFIG, Volunteers

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "infra"))
import prefect_local  # noqa: E402

pytestmark = pytest.mark.slow


def _wait(what, check, timeout, procs=()):
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited ({p.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _prefect(env, *args, timeout=120):
    return subprocess.run([str(BIN / "prefect"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), whatever session it moved to."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc, signals=2, grace=10.0):
    """SIGTERM (an idle `prefect worker` needs two), then SIGKILL for its process group and for
    whatever it started in sessions of their own (a worker's flow-run processes), so nothing
    outlives it."""
    below = _descendants(proc.pid)
    for i in range(signals):
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(1.0 if i < signals - 1 else grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(10)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(path, n=3000):
    return Path(path).read_text(errors="replace")[-n:] if Path(path).exists() else ""


def _close_clients():
    """Flush and close this process's log shipper and events client while the server is still up
    (left open, they report connection errors once it is gone)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=5, at_exit=False)


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    """Server, shared task storage, `prefect work-pool create`, `prefect deploy --all` and a
    `prefect worker` started outside the checkout (the pull step takes flow runs into it)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.aggregators import STORAGE_SETTING, save_task_storage
    tmp = tmp_path_factory.mktemp("production")
    port, home = _free_port(), tmp / "prefect"
    env = dict(os.environ, **prefect_local.settings(home, port), PREFECT_CLI_PROMPT="false")
    procs: list[subprocess.Popen] = []
    prefect_local.start(home, port, ui=False)
    try:
        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
            env[STORAGE_SETTING] = save_task_storage(f"file://{tmp}/task-storage")
        res = _prefect(env, "work-pool", "create", "dedloc", "--type", "process")
        assert res.returncode == 0, res.stdout + res.stderr
        res = _prefect(env, "--no-prompt", "deploy", "--all", timeout=240)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        for name in ("tokenize/production", "pretrain/production", "evaluate/production"):
            assert f"Deployment '{name}' successfully created" in res.stdout
        (tmp / "elsewhere").mkdir()
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "dedloc"],
                                  cwd=tmp / "elsewhere", env=env, stdout=open(tmp / "worker.log", "wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(worker)
        yield SimpleNamespace(env=env, tmp=tmp, api=env["PREFECT_API_URL"])
    finally:
        for p in procs:
            _stop(p)
        _close_clients()
        prefect_local.stop(home)
        print("worker log:\n" + _tail(tmp / "worker.log"))
    assert all(p.poll() is not None for p in procs)
    assert not prefect_local.healthy(port)


def _run_deployment(env, bucket, run, alive=(), **params):
    """`prefect deployment run pretrain/production --watch`: the flow run id and the finished
    command. Fails at once if one of the ``alive`` processes exits meanwhile."""
    params = {"bucket": bucket, "run": run, "rounds": 2, "poll_s": 0.2, "config": CONFIG, **params}
    cmd = subprocess.Popen([str(BIN / "prefect"), "deployment", "run", "pretrain/production", "--params",
                            json.dumps(params), "--watch", "--watch-interval", "1", "--watch-timeout", "240"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait("the flow run", lambda: cmd.poll() is not None, 300, alive)
    finally:
        if cmd.poll() is None:
            cmd.kill()
    out, err = cmd.communicate(timeout=30)
    res = subprocess.CompletedProcess(cmd.args, cmd.returncode, out, err)
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", res.stdout)
    return (m.group(1) if m else None), res


class Volunteering(Volunteers):
    """Volunteers that also leave when the test fails: the STOP marker sends them home."""

    def __init__(self, bucket, run, peers, until):
        super().__init__(bucket, run, peers, until)
        self.bucket, self.run = Bucket(bucket), run

    def __exit__(self, *exc):
        if exc[0] is not None:
            self.bucket.write_json(f"runs/{self.run}/STOP.json", {"by": "test teardown"})
        return super().__exit__(*exc)


async def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    async with get_client() as c:
        rounds = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        return await c.read_task_runs(flow_run_filter=rounds, limit=200)


def _replay_round(url, run, r, api):
    """Round r again in a copy of the bucket, by the threads runner: the same CLOSE, fresh
    reduction and state r+1."""
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    from flows.pretraining import round_flow
    src, dst = Path(url.removeprefix("file://")), Path(url.removeprefix("file://") + "-replay")
    shutil.copytree(src, dst)
    rn = Run(Bucket(f"file://{dst}"), run)
    shutil.rmtree(dst / rn.keys.state(r + 1))
    shutil.rmtree(dst / rn.keys.reduced(r).rsplit("/", 1)[0])
    rn.bucket.write_json(rn.keys.latest, {"state": r})
    assert Run(Bucket(f"file://{dst}"), run).latest() == r
    with temporary_settings({PREFECT_API_URL: api, PREFECT_LOGGING_TO_API_ENABLED: False}):
        round_flow(f"file://{dst}", run, r, poll_s=0.1, runner="threads")
    return Run(Bucket(f"file://{dst}"), run).commit_of(r + 1)


def test_prefect_yaml_deployment_aggregates_on_two_task_workers(production):
    """One flow run of pretrain/production: taken by the process worker from the pool, its
    rounds reduced and applied by two task workers."""
    tmp, env = production.tmp, production.env
    url = f"file://{tmp}/bucket-task-workers"
    logs = [tmp / f"aggregator-{i}.log" for i in (1, 2)]
    aggregators = []
    t0 = time.monotonic()
    try:
        for i, log in enumerate(logs, 1):  # its own PREFECT_HOME: no local storage shared with the flow
            aggregators.append(subprocess.Popen(
                [str(BIN / "dedloc"), "aggregator", "--limit", "1"], cwd=tmp,
                env=dict(env, PREFECT_HOME=str(tmp / f"aggregator-{i}")), stdout=open(log, "wb"),
                stderr=subprocess.STDOUT, start_new_session=True))
        _wait("both aggregators", lambda: all("serving" in _tail(log) for log in logs), 60, aggregators)
        with Volunteering(url, "tw", ["a", "b"], until=2):
            flow_run, res = _run_deployment(env, url, "tw", alive=aggregators, runner="task-workers")
            assert res.returncode == 0, (res.stdout[-3000:] + res.stderr[-2000:] + _tail(tmp / "worker.log")
                                         + "".join(_tail(log) for log in logs))
    finally:
        for p in aggregators:
            _stop(p, signals=1)
    took = time.monotonic() - t0
    assert all(p.poll() is not None for p in aggregators)
    run = Run(Bucket(url), "tw")
    assert run.latest() == 2
    commits = [run.commit_of(s) for s in (1, 2)]
    assert all(c["samples"] >= CONFIG["target_batch_size"] for c in commits)
    assert flow_run and "Completed" in res.stdout

    # Every reduce and apply of both rounds ran on a task worker, and both workers took some.
    done = [re.findall(r"^aggregator (\S+): (reduce_part|apply_part) tw round (\d) part (\d+) done",
                       _tail(log, 100_000), re.M) for log in logs]
    assert all(done), [_tail(log) for log in logs]
    assert len({who for d in done for who, *_ in d}) == 2
    ran = sorted((name, int(r), int(part)) for d in done for _, name, r, part in d)
    want = sorted((name, r, part) for name in ("reduce_part", "apply_part") for r in (0, 1)
                  for part in range(run.n_parts))
    assert ran == want
    from prefect.settings import PREFECT_API_URL, temporary_settings
    with temporary_settings({PREFECT_API_URL: production.api}):
        task_runs = asyncio.run(_task_runs(flow_run))
    agg = [t for t in task_runs if t.name.startswith(("reduce_part", "apply_part"))]
    assert len(agg) == len(want) and all(t.state.is_completed() for t in agg)

    # The same state as the threads runner makes from the same shards.
    again = _replay_round(url, "tw", 1, production.api)
    assert again["checksums"] == commits[1]["checksums"]
    assert (again["samples"], again["loss"]) == (commits[1]["samples"], commits[1]["loss"])
    print(f"pretrain/production with runner=task-workers, 2 rounds: {took:.1f}s; "
          f"parts per aggregator: {[len(d) for d in done]}")


def test_a_phase_nobody_serves_fails_in_time(production):
    """No aggregator serving (or another version of flows/): the phase raises, it does not hang."""
    from prefect import flow
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_LOGGING_TO_API_ENABLED,
        PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK,
        temporary_settings,
    )

    from flows.aggregators import STORAGE_SETTING, reduce_part, run_parts

    nothing = f"file://{production.tmp}/nothing"  # the flow goes with its task runs: capture no process

    @flow
    def phase():
        run_parts(reduce_part, nothing, "none", 0, [0, 1], timeout_s=2)

    with temporary_settings({PREFECT_API_URL: production.api, PREFECT_LOGGING_TO_API_ENABLED: False,
                             PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK: production.env[STORAGE_SETTING]}):
        # Pending: a busy server had not recorded the Scheduled state yet (flows.aggregators.wait_for)
        with pytest.raises(TimeoutError, match=r"runs not finished after 2s \(states: (Scheduled|Pending)\)"):
            phase()


def test_a_task_run_without_a_state_yet_is_waited_for():
    """Prefect's wait raises while a delayed task run has no state on a busy server: asked again
    (on a fake clock) until it has one; at the deadline it is the caller's to report; any other
    error goes through."""
    from dedloc_pipeline.testing import FakeClock
    from flows.aggregators import NO_STATE_POLL_S, wait_for

    class Future:
        def __init__(self, stateless: int, error: str = "has no state which means it hasn't started yet"):
            self.stateless, self.error, self.waits = stateless, error, []

        def wait(self, timeout):
            self.waits.append(timeout)
            if len(self.waits) <= self.stateless:
                raise RuntimeError(f"Task run x {self.error}.")

    clock = FakeClock()
    late = Future(stateless=3)
    wait_for(late, clock.monotonic() + 10, clock.sleep, clock.monotonic)
    assert late.waits == [10 - k * NO_STATE_POLL_S for k in range(4)]
    never = Future(stateless=10**6)
    wait_for(never, clock.monotonic() + 2, clock.sleep, clock.monotonic)  # returns at the deadline
    assert len(never.waits) == 2 / NO_STATE_POLL_S + 1 and never.waits[-1] == 0
    with pytest.raises(RuntimeError, match="boom"):
        wait_for(Future(stateless=1, error="boom"), clock.monotonic() + 2, clock.sleep, clock.monotonic)
