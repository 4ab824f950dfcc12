"""A volunteer's install: the wheel `make wheel` builds, installed into a fresh environment with
the package's own dependencies only (no extra), joins a run on moto's S3 server.

The fresh environment gets what a volunteer's `pip install` gets: the worker's dependencies at
the versions of requirements.lock, torch the CPU build this machine carries (constraints.txt).
The organizer's side (Prefect, matplotlib), the tests' tools and the evaluation's data sets are
extras, so they must not be there, and `dedloc --help` must not import torch. The scheduler runs
from the development environment, as an organizer's would on another machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
# what only the organizer, the evaluation or the tests use: never in a volunteer's install
NOT_A_VOLUNTEERS = ("prefect", "matplotlib", "pytest", "moto", "datasets", "pandas", "dask", "ipykernel", "ruff")


@pytest.fixture(scope="module")
def volunteer(tmp_path_factory) -> Path:
    """A fresh environment holding the wheel of `make wheel` and what it depends on; its bin/."""
    tmp = tmp_path_factory.mktemp("install")
    subprocess.run(["make", "-s", "wheel", f"DIST={tmp / 'dist'}"], cwd=ROOT, check=True, timeout=300)
    wheels = list((tmp / "dist").glob("dedloc_pipeline-*-py3-none-any.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120)
    started = time.monotonic()
    # --no-compile: what is installed is checked here, not its bytecode (a third of pip's time)
    pip = subprocess.run([str(tmp / "venv" / "bin" / "pip"), "install", "-q", "--no-compile", "-c",
                          str(ROOT / "constraints.txt"), "-c", str(ROOT / "requirements.lock"), str(wheels[0])],
                         capture_output=True, text=True, timeout=480)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    listed = subprocess.run([str(tmp / "venv" / "bin" / "pip"), "list", "--format", "json"], check=True,
                            capture_output=True, text=True).stdout
    size = sum(f.stat().st_size for f in (tmp / "venv").rglob("*") if f.is_file() and not f.is_symlink())
    print(f"a volunteer's install: {time.monotonic() - started:.0f} s, {size / 1e9:.2f} GB, "
          f"{len(json.loads(listed))} packages")
    return tmp / "venv" / "bin"


def test_a_volunteers_install_holds_the_worker_and_not_the_organizers_side(volunteer):
    names = {p["name"].lower() for p in json.loads(subprocess.run(
        [str(volunteer / "pip"), "list", "--format", "json"], check=True, capture_output=True, text=True).stdout)}
    assert {"dedloc-pipeline", "torch", "transformers", "s3fs", "zarr", "lz4"} <= names
    assert not names & set(NOT_A_VOLUNTEERS), names & set(NOT_A_VOLUNTEERS)
    # `dedloc --help` answers without the heavy imports: a mistake is told at once
    probe = ("import sys\nsys.argv = ['dedloc', '--help']\nfrom dedloc_pipeline.cli import app\n"
             "try:\n    app()\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
             "print(sorted(m for m in ('torch', 'prefect', 'matplotlib', 'transformers') if m in sys.modules))")
    out = subprocess.run([str(volunteer / "python"), "-c", probe], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    assert "worker" in out and out.strip().splitlines()[-1] == "[]", out
    # the organizer's side, asked for anyway: one line naming the extra
    res = subprocess.run([str(volunteer / "dedloc"), "plot", "--bucket", "memory://x", "--run", "r", "--out", "x"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip() == (
        "error: 'dedloc plot' needs matplotlib, of the organizer extra, which a volunteer's install leaves out: "
        "pip install 'dedloc-pipeline[organizer]'"), res.stderr


def test_a_volunteers_install_joins_a_run_on_s3(volunteer, s3_bucket, tmp_path):
    """The fresh install's `dedloc worker` trains two rounds of a run on moto's server beside a
    scheduler of the development environment (in this process: one torch start-up less); it
    stops at state 2, and the rounds count it."""
    url = s3_bucket.url
    res = CliRunner().invoke(app, ["init", "--bucket", url, "--run", "joined", "--preset", "micro", "--seq-len", "32",
                                   "--target-batch", "16", "--micro-batch", "4", "--warmup-steps", "0"])
    assert res.exit_code == 0, res.output
    run = Run(Bucket(url), "joined")
    with ThreadPoolExecutor(1) as pool, open(tmp_path / "volunteer.log", "w") as log:
        scheduler = pool.submit(Scheduler(run, 1, 0.2).serve, 2)
        proc = subprocess.Popen([str(volunteer / "dedloc"), "worker", "--peer-id", "fresh", "--threads", "1",
                                 "--bucket", url, "--run", "joined", "--until-round", "2", "--poll", "0.2"],
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout=420)
            assert scheduler.result(timeout=120) == 2
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if not scheduler.done():
                run.bucket.write_json(run.keys.stop(), {"by": "the test"})  # the scheduler ends after its round
    output = (tmp_path / "volunteer.log").read_text()[-3000:]
    assert code == 0, output
    assert run.latest() == 2
    assert all(run.commit_of(s)["contributors"] == ["fresh"] for s in (1, 2)), output
