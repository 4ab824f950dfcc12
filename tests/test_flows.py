"""The Prefect flows against Prefect's test harness (a real temporary API), with volunteer
workers running beside them as threads on a local bucket."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest

from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.volunteer.worker import Worker

from .conftest import CORPUS, SMALL

pytestmark = pytest.mark.slow  # a Prefect server (the test harness's) in its own process

CONFIG = dict(SMALL, target_batch_size=24, micro_batch=4, codec="int8", peer_timeout_s=30.0)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=120):
        yield


class Volunteers:
    """Worker threads that join once the run exists and leave at state ``until``."""

    def __init__(self, bucket: str, run: str, peers: list[str], until: int):
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._work, args=(bucket, run, p, until), daemon=True)
                        for p in peers]

    def _work(self, bucket, run, peer, until):
        try:
            b = Bucket(bucket)
            while not b.exists(f"runs/{run}/state/LATEST.json"):
                threading.Event().wait(0.2)
            Worker(Run(b, run), peer, threads=1, poll_s=0.2).serve(until)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def __enter__(self):
        [t.start() for t in self.threads]
        return self

    def __exit__(self, *exc):
        [t.join(120) for t in self.threads]
        assert not self.errors, self.errors


def _artifacts(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return asyncio.run(read())


def test_pretrain_flow_commits_rounds_and_publishes_artifacts(harness, tmp_path):
    from flows.pretraining import pretrain
    url = f"file://{tmp_path}/bucket"
    with Volunteers(url, "flow", ["a", "b"], until=3):
        out = pretrain(bucket=url, run="flow", rounds=3, config=CONFIG, poll_s=0.2)
    assert out["state"] == 3 and out["rounds_done"] == 3 and out["stopped_by"] == "rounds"
    run = Run(Bucket(url), "flow")
    assert [run.commit_of(s)["loss"] for s in (1, 2, 3)] == out["losses"]
    rounds = _artifacts("flow-round")
    assert len(rounds) == 3 and all(a.type == "table" for a in rounds)
    rows = [row for a in rounds for row in (json.loads(a.data) if isinstance(a.data, str) else a.data)]
    assert sorted(row["round"] for row in rows) == [0, 1, 2]
    progress = _artifacts("flow-progress")
    assert progress and progress[0].data == 100.0


def test_stop_marker_ends_the_flow(harness, tmp_path):
    from dedloc_pipeline.protocol.config import RunConfig
    from dedloc_pipeline.protocol.run import init_run
    from flows.pretraining import pretrain
    b = Bucket(f"file://{tmp_path}/bucket")
    run = init_run(b, RunConfig(run="stopped", **CONFIG))
    b.write_json(run.keys.stop(), {"by": "organizer"})
    out = pretrain(bucket=b.url, run="stopped", rounds=5, poll_s=0.1)
    assert out["stopped_by"] == "STOP marker" and out["state"] == 0


def test_the_pretrain_flow_takes_volunteer_aggregators_as_a_runner(harness, tmp_path, monkeypatch):
    """runner="volunteers": a signed run, a and b computing on threads, x and y serving as
    volunteer aggregators on threads (real clocks): every part of every round is settled by x
    and y and COMMIT names them; a round they do not settle would fall back to the flow's own
    reduce and apply tasks (tests/test_aggregators.py)."""
    from dedloc_pipeline.protocol.config import RunConfig
    from dedloc_pipeline.protocol.run import init_run
    from dedloc_pipeline.trust import identity
    from dedloc_pipeline.volunteer.aggregator import AggregatorRole
    from flows.pretraining import pretrain
    keys = {n: identity.generate(tmp_path / f"{n}.pem") for n in ("org", "a", "b", "x", "y")}
    monkeypatch.setenv("DEDLOC_ORGANIZER_KEY", str(tmp_path / "org.pem"))
    b = Bucket(f"file://{tmp_path}/bucket")
    run = init_run(b, RunConfig(run="helped", **dict(CONFIG, chunks_per_part=2),
                                organizer_key=identity.public(keys["org"]), close={"aggregate_s": 60.0}))
    identity.update_roster(b, "helped", keys["org"], enroll={n: identity.public(keys[n]) for n in "abxy"},
                           aggregate=["x", "y"])
    done, errors = threading.Event(), []

    def serve(target):
        try:
            target()
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)
    threads = [threading.Thread(target=serve, args=(lambda p=p: Worker(Run(Bucket(b.url), "helped"), p, threads=1,
                                                                        poll_s=0.2, signer=keys[p]).serve(2),))
               for p in "ab"]
    threads += [threading.Thread(target=serve, args=(lambda p=p: AggregatorRole(Run(Bucket(b.url), "helped"), p,
                                                                                 keys[p]).serve(done.is_set, 0.1),))
                for p in "xy"]
    [t.start() for t in threads]
    try:
        for _ in range(1200):  # both offered for round 0 before the flow's first poll can close it
            if all(b.exists(run.keys.offer(0, p)) for p in "xy") or errors:
                break
            threading.Event().wait(0.05)
        out = pretrain(bucket=b.url, run="helped", rounds=2, poll_s=0.2, runner="volunteers")
    finally:
        done.set()
        [t.join(120) for t in threads]
    assert not errors, errors
    assert out["state"] == 2
    for s in (1, 2):
        assert all(sorted(by) == ["x", "y"] for by in run.commit_of(s)["aggregated_by"]), run.commit_of(s)


def test_tokenize_makes_a_bengali_data_set_once(harness, tmp_path):
    """The offline corpus as a data set: tokenizer, shards and card, with the corpus's licence;
    the same recipe again keeps it as it is. Pretraining and evaluating on it through the
    deployment is `make pretrain`'s (tests/test_deployment.py)."""
    from flows.tokenization import tokenize
    url = f"file://{tmp_path}/bucket"
    card = tokenize(bucket=url, data="bn", vocab_size=500, seq_len=32, max_documents=60, corpus_dir=CORPUS)
    assert card["vocab_size"] == 500 and card["splits"]["train"]["pairs"] > 60
    assert card["documents"] == 60 and card["sources"]["summary"]["documents_read"] > 9000
    [src] = card["sources"]["sources"]
    assert src["url"].endswith("shobdo.txt") and src["licence"].startswith("Apache-2.0 (shobdo 0.2.2")
    assert Bucket(url).read_json("data/bn/DATA.json") == card
    again = tokenize(bucket=url, data="bn", vocab_size=500, seq_len=32, max_documents=60, corpus_dir=CORPUS)
    assert again["created_at"] == card["created_at"]  # same recipe: kept, not remade
    other = tokenize(bucket=url, data="bn", vocab_size=500, seq_len=32, max_documents=50, corpus_dir=CORPUS)
    assert other["created_at"] != card["created_at"]  # another recipe: made anew
    assert other["splits"]["train"]["pairs"] < card["splits"]["train"]["pairs"]
    from dedloc_pipeline.model.data import PairSource
    PairSource(Bucket(url), "bn", seed=0).sample("x", 0)  # the new card's shards, checked by their hashes
    assert sorted(Bucket(url).find("data/bn/train")) == sorted(s["key"] for s in other["splits"]["train"]["shards"])


def test_evaluate_synthetic_run_scores_heldout_only(harness, tmp_path):
    from dedloc_pipeline.protocol.config import RunConfig
    from dedloc_pipeline.protocol.run import init_run
    from flows.evaluation import evaluate
    from flows.tokenization import tokenize
    url = f"file://{tmp_path}/bucket"
    card = tokenize(bucket=url, data="synthetic", seq_len=32)
    assert card["name"] == "synthetic" and len(card["preview_input_ids"]) == 3
    init_run(Bucket(url), RunConfig(run="syn", **CONFIG))
    res = evaluate(bucket=url, run="syn", samples=16)
    assert set(res) == {"state", "mlm-heldout"} and res["mlm-heldout"]["sop_accuracy"] is None
    with pytest.raises(ValueError, match="no tokenizer"):
        evaluate(bucket=url, run="syn", samples=16, tasks=["ner"])


DASK_CASE = "DEDLOC_DASK_CASE"


@pytest.mark.skipif(not os.environ.get(DASK_CASE), reason="run in its own interpreter by the test below")
@pytest.mark.timeout(240)
def test_dask_case(harness, tmp_path):
    """runner="dask": the reduce and apply tasks run on a Dask cluster's workers."""
    from flows.pretraining import pretrain
    url = f"file://{tmp_path}/bucket"
    with Volunteers(url, "dask", ["a", "b"], until=2):
        out = pretrain(bucket=url, run="dask", rounds=2, config=CONFIG, poll_s=0.2, runner="dask", parallel=2)
    assert out["state"] == 2 and out["rounds_done"] == 2
    run = Run(Bucket(url), "dask")
    assert all(run.bucket.exists(run.keys.applied(2, k)) for k in range(run.n_parts))


@pytest.mark.timeout(330)
def test_aggregation_scales_out_to_a_dask_cluster(tmp_path):
    """The Dask case once, in a fresh interpreter in a process group of its own, bounded from here:
    a frozen interpreter cannot run pytest-timeout's handler. A hang fails with the stacks that
    faulthandler dumps (it needs no GIL), and the whole group is killed, its Prefect test server
    too. (The freeze this once retried: Dask's worker profiler deadlocking CPython 3.11, see
    flows.common.dask_address.)"""
    pytest.importorskip("prefect_dask", reason="the 'scale' extra is not installed")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=230",
           "-o", "faulthandler_exit_on_timeout=true", f"{__file__}::test_dask_case"]
    log = tmp_path / "dask-case.log"  # a file, not a pipe: an orphaned server cannot hold it open
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=dict(os.environ, **{DASK_CASE: "1"}), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    hung = False
    try:
        proc.wait(timeout=280)
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        if proc.poll() is None or proc.returncode != 0:  # what it started may be orphaned
            _kill_group(proc.pid)
            proc.wait()
    out = log.read_text(errors="replace")
    assert proc.returncode == 0 and "1 passed" in out, ("hung, killed after 280 s\n" if hung else "") + out[-12000:]


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the group (what a killed pytest started and never stopped)."""
    import signal
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
