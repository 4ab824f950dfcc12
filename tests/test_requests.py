"""Requests as the S3 server counts them: the project's counters equal moto's own request log,
and the calls that poll a run cost one request each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest

from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket

from .conftest import _free_port, small_config
from dedloc_pipeline.testing import collaborate

_LINE = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


class LoggedS3:
    """moto's standalone server with its request log kept: one line per request it answered."""

    def __init__(self, log_path):
        self.port, self.log_path = _free_port(), log_path
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_DEFAULT_REGION="us-east-1")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[tuple[str, str]]:
        """(method, query) of every request logged so far, in order."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return [(m.group(1), m.group(2)) for m in map(_LINE.search, f) if m]

    def wait_logged(self, n: int, timeout: float = 10.0) -> list[tuple[str, str]]:
        """The log once it holds ``n`` requests (it is written after each reply)."""
        deadline = time.monotonic() + timeout
        while len(got := self.requests()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def logged_s3(tmp_path, monkeypatch):
    server = LoggedS3(tmp_path / "moto.log")
    for k, v in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                     AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=server.url).items():
        monkeypatch.setenv(k, v)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                Bucket("s3://probe").fs.ls("")
                break
            except Exception:
                assert time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.2)
        yield server
    finally:
        server.stop()


def _by_kind(logged: list[tuple[str, str]]) -> Counter:
    """The server's requests in the Bucket's kinds: a GET with ``list-type`` is a LIST, a POST
    ``?delete`` a multi-object DELETE."""
    out = Counter()
    for method, path in logged:
        if method == "GET" and "list-type=" in path:
            out["list"] += 1
        elif method == "POST" and "delete" in path:
            out["delete"] += 1
        else:
            out[method.lower()] += 1
    return out


def test_the_counters_equal_the_servers_count_over_a_collaboration(logged_s3):
    name = f"dedloc-{uuid.uuid4().hex[:8]}"
    Bucket(f"s3://{name}").fs.mkdir(name)
    bucket = Bucket(f"s3://{name}/collab")
    before = len(logged_s3.wait_logged(1))
    run = init_run(bucket, small_config("counted"))
    collaborate(run, [("a", 4), ("b", 4)], rounds=2)
    ours = Counter(bucket.stats.snapshot()["requests"])
    logged = logged_s3.wait_logged(before + sum(ours.values()))[before:]
    theirs = _by_kind(logged)
    assert sum(ours.values()) == len(logged) > 100, (ours, theirs)
    assert ours == theirs, (ours, theirs)


def test_a_poll_costs_one_request_per_check(logged_s3):
    """An existence check is one HEAD, a small read (present or missing) one GET: no directory
    probes (LIST) and no HEAD before a GET."""
    name = f"dedloc-{uuid.uuid4().hex[:8]}"
    Bucket(f"s3://{name}").fs.mkdir(name)
    b = Bucket(f"s3://{name}/p")
    b.write_json("x/LATEST.json", {"state": 1})
    start = len(logged_s3.wait_logged(2))
    assert b.exists("x/LATEST.json") and not b.exists("x/STOP.json")
    assert b.read_json("x/LATEST.json") == {"state": 1} and b.read_json("x/CLOSE.json") is None
    got = [m for m, _ in logged_s3.wait_logged(start + 4)[start:]]
    assert got == ["HEAD", "HEAD", "GET", "GET"]
    assert b.stats.snapshot()["requests"] == {"put": 1, "head": 2, "get": 2}
