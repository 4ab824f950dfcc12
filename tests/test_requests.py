"""Requests as the S3 server counts them: the project's counters equal moto's own request log,
and the calls that poll a run cost one request each. On the session's moto server (conftest's
``s3_server``), each case in a fresh bucket, counting the log's lines after a marker request."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import collaborate, moto_log

from .conftest import small_config

pytestmark = pytest.mark.slow


def logged_after(server, mark: str, n: int, timeout: float = 10.0) -> list:
    """The requests logged after the one for key ``mark``, once there are ``n`` (a line is
    written as the server answers, so it can trail the reply a little)."""
    deadline = time.monotonic() + timeout
    while True:
        logged = moto_log(server.log)
        at = next((i for i, x in enumerate(logged) if x.path.endswith(mark)), None)
        got = [] if at is None else logged[at + 1:]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def marker(server, bucket: Bucket) -> str:
    """A HEAD the case's own counters do not see (another Bucket object): where its requests
    start in the server's log."""
    mark = f"mark-{uuid.uuid4().hex[:8]}"
    Bucket(bucket.url).exists(mark)
    logged_after(server, mark, 0)
    return mark


def test_the_counters_equal_the_servers_count_over_a_collaboration(s3_server, s3_bucket):
    mark = marker(s3_server, s3_bucket)
    run = init_run(s3_bucket, small_config("counted"))
    collaborate(run, [("a", 4), ("b", 4)], rounds=2)
    ours = Counter(s3_bucket.stats.snapshot()["requests"])
    logged = logged_after(s3_server, mark, sum(ours.values()))
    theirs = Counter(x.kind for x in logged)
    assert sum(ours.values()) == len(logged) > 100, (ours, theirs)
    assert ours == theirs, (ours, theirs)


def test_a_poll_costs_one_request_per_check(s3_server, s3_bucket):
    """An existence check is one HEAD, a small read (present or missing) one GET: no directory
    probes (LIST) and no HEAD before a GET."""
    b = s3_bucket
    b.write_json("x/LATEST.json", {"state": 1})
    mark = marker(s3_server, b)
    assert b.exists("x/LATEST.json") and not b.exists("x/STOP.json")
    assert b.read_json("x/LATEST.json") == {"state": 1} and b.read_json("x/CLOSE.json") is None
    got = [x.method for x in logged_after(s3_server, mark, 4)]
    assert got == ["HEAD", "HEAD", "GET", "GET"]
    assert b.stats.snapshot()["requests"] == {"put": 1, "head": 2, "get": 2}
