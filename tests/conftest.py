"""Shared fixtures: small runs on real buckets (a local folder, and moto's S3 server on loopback)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from types import SimpleNamespace

import pytest

# No telemetry from the tests: set before anything imports Prefect, and inherited by every process
# they start (servers, workers, CLIs, the Dask case's own interpreter).
os.environ.update({
    "DO_NOT_TRACK": "1",                                       # Prefect's SDK analytics; the convention
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",               # the Prefect server's telemetry service
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",   # Prefect's run telemetry (Cloud only)
    "HF_HUB_DISABLE_TELEMETRY": "1",                           # huggingface_hub (transformers, datasets)
})
# Volunteers pin organizer keys (trust/pins.py) in a file of this test process's own, not the home's.
os.environ["DEDLOC_PINS"] = os.path.join(tempfile.mkdtemp(prefix="dedloc-pins-"), "pins.json")
# On pytest-xdist's processes (`make test` runs two), torch and what the tests start compute on one
# thread each: on two cores the suite took 37 min of CPU with two threads a process, 33 with one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

# Every process the tests start carries this session's id in its environment, so the check at
# the end of the run finds it even after its parent died and it was reparented (a killed
# subprocess's Prefect test server). A nested pytest (the Dask case) appends its own id.
_SESSIONS_VAR = "DEDLOC_TEST_SESSIONS"
_SESSION_ID = uuid.uuid4().hex[:12]
os.environ[_SESSIONS_VAR] = ":".join(filter(None, [os.environ.get(_SESSIONS_VAR), _SESSION_ID]))

from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import SMALL, TINY, small_config

__all__ = ["SMALL", "TINY", "small_config"]  # tests import them from here


@pytest.fixture
def bucket(tmp_path) -> Bucket:
    return Bucket(f"file://{tmp_path}/bucket")


@pytest.fixture
def make_run(bucket):
    def make(**kw):
        return init_run(bucket, small_config(**kw))
    return make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> SimpleNamespace:
    """moto's standalone S3 server on loopback, as s3fs's own tests use, one per test session
    (each case makes its own bucket); ``log`` is its request log, a line per request answered
    (``dedloc_pipeline.testing.moto_log`` reads it)."""
    port, log = _free_port(), tmp_path_factory.mktemp("moto") / "moto.log"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("moto server did not start")
    yield SimpleNamespace(url=url, log=log)
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def s3_endpoint(s3_server) -> str:
    return s3_server.url


# The modules of the real-part smokes and the checks' suite, longest first. `make test` runs the suite on two processes
# a module at a time (pytest-xdist's loadfile); these go first, so neither process ends with a
# minutes-long module while the other is idle.
LONG_MODULES = ("test_deployment", "test_install", "test_flows", "test_production", "test_e2e", "test_soak",
                "test_hostile", "test_checks")


def pytest_collection_modifyitems(items):
    """A case on moto's server is a server case: slow (the fast tier, ``-m "not slow"``, starts
    no process). The long modules run first."""
    for item in items:
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> Bucket:
    """A fresh S3 bucket on the loopback server; credentials through the usual AWS variables."""
    for k, v in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                     AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s3_endpoint).items():
        monkeypatch.setenv(k, v)
    name = f"dedloc-{uuid.uuid4().hex[:10]}"
    Bucket(f"s3://{name}").fs.mkdir(name)
    return Bucket(f"s3://{name}/collab")


CORPUS = os.path.join(os.path.dirname(__file__), os.pardir, ".dedloc", "corpus")


@pytest.fixture(scope="session")
def bengali(tmp_path_factory):
    """A small tokenized data set from the offline Bengali corpus (`make corpus`): 400 documents,
    a 2000-token tokenizer, sequences of 32, shards of 64 pairs. Returns (bucket URL, name)."""
    from dedloc_pipeline.dataset.build import Recipe, make
    from dedloc_pipeline.dataset.sources import embedded
    url = f"file://{tmp_path_factory.mktemp('data')}/bucket"
    make(Bucket(url), "bn-test", Recipe(sources=(embedded(CORPUS),), vocab_size=2000, seq_len=SMALL["seq_len"],
                                        max_documents=400, shard_pairs=64))
    return url, "bn-test"


def _processes() -> dict[int, tuple[int, str, list[str], list[str]]]:
    """pid -> (ppid, state, argv, test sessions) from /proc, for every process still there
    (none where there is no /proc: the check is Linux's)."""
    procs = {}
    for name in (os.listdir("/proc") if os.path.isdir("/proc") else []):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except PermissionError:
                env = []
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # gone meanwhile
        prefix = f"{_SESSIONS_VAR}=".encode()
        sessions = next((e[len(prefix):].decode().split(":") for e in env if e.startswith(prefix)), [])
        procs[int(name)] = (int(ppid), state, argv, sessions)
    return procs


def _server_kind(argv: list[str]) -> str | None:
    """What kind of server a command line starts, or None for anything else."""
    words = {os.path.basename(a) for a in argv}
    if "uvicorn" in words:
        return "Prefect server (uvicorn)"
    if "prefect" in words and "server" in words:
        return "Prefect server"
    if "prefect" in words and "worker" in words:
        return "Prefect worker"
    if "flows.serve" in words:
        return "served deployments (flows.serve)"
    if words & {"moto.server", "moto_server"}:
        return "moto server"
    if words & {"dask-scheduler", "distributed.cli.dask_scheduler"} or {"dask", "scheduler"} <= words:
        return "Dask scheduler"
    if words & {"dask-worker", "distributed.cli.dask_worker"} or {"dask", "worker"} <= words:
        return "Dask worker"
    return None


def _survivors() -> tuple[list[tuple[int, str, list[str]]], list[tuple[int, list[str]]]]:
    """This session's live processes besides pytest itself: (servers, others). A process is this
    session's if it descends from pytest or carries the session's id."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(pid)
    ours, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in ours:
                ours.add(child)
                todo.append(child)
    ours |= {pid for pid, (*_, sessions) in procs.items() if _SESSION_ID in sessions}
    ours.discard(os.getpid())
    servers, others = [], []
    for pid in sorted(ours):
        _, state, argv, _ = procs[pid]
        if state in ("Z", "X"):  # dead, only not yet reaped
            continue
        kind = _server_kind(argv)
        (servers.append((pid, kind, argv)) if kind else others.append((pid, argv)))
    return servers, others


def _kill(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still there after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            alive = [p for p in pids if _processes().get(p, (0, "Z"))[1] not in ("Z", "X")]
            if not alive:
                return
            time.sleep(0.2)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """No server a test started may outlive the run: kill any that did and fail the run.
    trylast: after pytest's own hook has torn down the session's fixtures."""
    servers, others = _survivors()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.ensure_newline()
    say = tr.write_line if tr is not None else (lambda line, **kw: print(line, file=sys.stderr))
    for pid, argv in others:
        say(f"note: process {pid} started by the tests is still running: {' '.join(argv)[:200]}")
    if servers:
        for pid, kind, argv in servers:
            say(f"LEAK: {kind} (pid {pid}) outlived the tests, killed: {' '.join(argv)[:200]}", red=True)
        _kill([pid for pid, _, _ in servers])
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
