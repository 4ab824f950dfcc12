"""The deployment path on a real local Prefect server: served flows triggered by name, a
cancelled pretrain run restarted, and `make pretrain` itself in a short form."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket

from .conftest import _free_port
from .test_flows import CONFIG, Volunteers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "infra"))
import prefect_local  # noqa: E402

pytestmark = pytest.mark.slow


def _wait(what, check, timeout):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture
def served(tmp_path):
    """A local server on a free port, and `python -m flows.serve` serving the deployments."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    port, home = _free_port(), tmp_path / "prefect"
    prefect_local.start(home, port, ui=False)
    env = dict(os.environ, **prefect_local.settings(home, port))
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([sys.executable, "-m", "flows.serve"], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
            from prefect.client.orchestration import get_client

            async def deployed():
                async with get_client() as c:
                    try:
                        await c.read_deployment_by_name("pretrain/local")
                        return True
                    except Exception:
                        return False
            _wait("the served deployments", lambda: asyncio.run(deployed()), 120)
            yield
    finally:
        serve.terminate()
        serve.wait(30)
        prefect_local.stop(home)
        print((tmp_path / "serve.log").read_text(errors="replace")[-3000:])


async def _cancel(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling
    async with get_client() as c:
        await c.set_flow_run_state(flow_run_id, Cancelling(), force=True)


async def _state(flow_run_id):
    from prefect.client.orchestration import get_client
    async with get_client() as c:
        return (await c.read_flow_run(flow_run_id)).state


def test_a_prefect_server_this_project_did_not_start_is_refused(tmp_path):
    """The report: `make pretrain` beside another Prefect server on its port (a Prefect user's
    default, 4200) attached its deployments to it, said it had started it, and when that server
    stopped waited 300 s for nothing. A server answering the port with none running from this
    project's home is refused, naming the way out."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        assert prefect_local.healthy(port)
        with pytest.raises(RuntimeError) as err:
            prefect_local.start(tmp_path / "prefect", port, ui=False)
    finally:
        other.shutdown()
        other.server_close()
    assert str(err.value) == (
        f"port {port} answers with a Prefect server this project did not start (none is running from "
        f"{(tmp_path / 'prefect').resolve()}): stop that one, or use another port (make pretrain "
        f"PREFECT_PORT={port + 100})")
    assert not (tmp_path / "prefect").exists()


def test_served_pretrain_survives_cancel_and_restart(served, tmp_path):
    from prefect.deployments import run_deployment
    url = f"file://{tmp_path}/bucket"
    with Volunteers(url, "dep", ["a", "b"], until=4):
        first = run_deployment("pretrain/local", timeout=0, as_subflow=False, parameters={
            "bucket": url, "run": "dep", "rounds": 4, "config": CONFIG, "poll_s": 0.2})
        b = Bucket(url)
        _wait("state 1", lambda: b.exists("runs/dep/state/00000001/COMMIT.json"), 240)
        asyncio.run(_cancel(first.id))
        _wait("the cancelled run to end", lambda: asyncio.run(_state(first.id)).is_final(), 120)
        assert asyncio.run(_state(first.id)).is_cancelled()
        stopped_at = Run(b, "dep").latest()
        assert stopped_at < 4
        second = run_deployment("pretrain/local", timeout=600, poll_interval=1, as_subflow=False,
                                parameters={"bucket": url, "run": "dep", "rounds": 4, "poll_s": 0.2})
        assert second.state.is_completed(), second.state
    run = Run(b, "dep")
    assert run.latest() == 4
    commits = [run.commit_of(s) for s in range(1, 5)]
    assert [c["round"] for c in commits] == [0, 1, 2, 3]
    assert all(c["samples"] >= CONFIG["target_batch_size"] for c in commits)


def test_make_pretrain_runs_a_whole_collaboration(tmp_path):
    """The first run, shortened (4 rounds of the micro preset on a capped corpus): tokenizer,
    signed rounds from two worker processes, evaluation and fine-tuning, and what it says: the
    summary, the learning curve's PNG, and a last line in plain words. Whether 4 rounds inside the
    recipe's 20-step warmup get below the unigram start depends on which samples fill them, so that
    is not asserted here: tiny's learning on the Bengali corpus is test_data's, in one process."""
    port = _free_port()
    env = dict(os.environ, BUCKET=f"file://{tmp_path}/bucket", RUN="ci", ROUNDS="4", WORKERS="2",
               PRESET="micro", TARGET="32", PREFECT_PORT=str(port), DEDLOC_PREFECT_HOME=str(tmp_path / "prefect"),
               LOGS=str(tmp_path / "logs"), PREFECT_UI="0", MAX_DOCS="300", EVAL_EPOCHS="1", EVAL_TRAIN="48")
    res = subprocess.run(["make", "--no-print-directory", "pretrain"], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = Run(Bucket(env["BUCKET"]), "ci")
    assert run.latest() == 4 and run.seq_len == 64  # the first run's sequences
    assert Bucket(env["BUCKET"]).read_json("data/bengali/DATA.json")["vocab_size"] == 2000
    assert run.config.organizer_key and run.commit_of(4)["rejected"] == []  # a signed run, enrolled workers
    assert {p for s in range(1, 5) for p in run.commit_of(s)["contributors"]} <= {"local-1", "local-2"}
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["rounds"] == 4
    assert summary["samples"] == sum(run.commit_of(s)["samples"] for s in range(1, 5))
    assert summary["first_loss"] == run.commit_of(1)["loss"] and summary["last_loss"] == run.commit_of(4)["loss"]
    assert run.config.unigram_bias  # the run starts at the unigram loss
    assert Bucket(env["BUCKET"]).read_json("runs/ci/evals/00000004/mlm-heldout.json")["loss"] == summary["eval"]["loss"]
    assert [s for s, _ in summary["curve"]] == [0, 1, 2, 3, 4]  # ROUNDS // 10 < 1: every state kept
    assert summary["curve"][0][1] == summary["eval"]["random_init_loss"]
    assert summary["curve"][-1][1] == summary["eval"]["loss"]
    png = Path(summary["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"learning curve: {png}" in res.stdout
    assert "run ci: 4 rounds in" in res.stdout and "held-out MLM loss: " in res.stdout
    last = res.stdout.rstrip().splitlines()[-1]  # says what the numbers say, either way
    assert last.startswith("In plain words: ") and "2 volunteers on this machine" in last
    learned = summary["eval"]["loss"] < summary["eval"]["random_init_loss"]
    assert ("trained the model" if learned else "did not move the model below random init") in last
    assert set(summary["downstream"]) == {"ner", "news"}  # both fine-tuning numbers, with their baselines
    assert all(0 <= v[k] <= 1 for v in summary["downstream"].values() for k in ("pretrained", "random_init"))
    assert "ner (offline stand-in" in res.stdout and "news (offline stand-in" in res.stdout
    assert not prefect_local.healthy(port)  # it shut the server down
