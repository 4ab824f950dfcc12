"""The notebook volunteer's first run: dedloc_pipeline.join() executed in a real Jupyter kernel
(nbclient driving ipykernel, as a notebook frontend does) against a local run with a scheduler."""

from __future__ import annotations

import ast
import re
import threading

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

from dedloc_pipeline.monitoring.volunteer import summary_text
from dedloc_pipeline.organizer.scheduler import Scheduler

ROUNDS = 3

CELL = """
import logging
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
logging.getLogger("dedloc_pipeline").setLevel(logging.INFO)  # log lines while the panel is drawn
import dedloc_pipeline
summary = dedloc_pipeline.join(bucket={bucket!r}, run={run!r}, peer_id="alice", device="cpu",
                               until_round={rounds}, threads=1, poll=0.1)
summary
"""


class RecordingClient(NotebookClient):
    """Keeps every display message of the cell: nbclient itself keeps only the final outputs."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.displays: list[dict] = []

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] in ("display_data", "update_display_data"):
            self.displays.append(msg)
        return super().process_message(msg, cell, cell_index)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_join_in_a_notebook_draws_one_panel_in_place(make_run, bucket, tmp_path):
    """One display output, redrawn in place while alice works through three rounds, that ends
    showing what she did (progress toward the target, ETA, pending/uploaded/counted, speed,
    traffic); no plain progress lines, no warning on stderr (tqdm's "IProgress not found"
    among them); join's summary printed once and returned."""
    run = make_run()
    scheduler = threading.Thread(target=Scheduler(run, parallel=1, poll_s=0.05).serve, daemon=True)
    scheduler.start()  # until STOP: publishing round views after the last commit, as in a real run
    kernels = tmp_path / "kernels"
    write_kernel_spec(str(kernels / "python3"))  # this interpreter, whatever is installed globally
    km = AsyncKernelManager(kernel_name="python3",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        CELL.format(bucket=bucket.url, run=run.name, rounds=ROUNDS))])
    client = RecordingClient(nb, km=km, timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute(cleanup_kc=True)  # the kernel is shut down however the cell ends
    finally:
        run.bucket.create_json(run.keys.stop(), {"reason": "test over"})
        scheduler.join(30)
    assert not scheduler.is_alive()
    outputs = nb.cells[0].outputs

    result = [o for o in outputs if o.output_type == "execute_result"]
    assert len(result) == 1, outputs
    s = ast.literal_eval(result[0].data["text/plain"])  # the returned dict's repr
    assert s["ended"] == "until_round" and s["state"] == ROUNDS, s
    assert s["samples_counted"] == s["samples_uploaded"] == ROUNDS * run.config.target_batch_size, s

    # one display, created once and updated in place, each update a panel that moved
    first = [m["content"] for m in client.displays if m["msg_type"] == "display_data"]
    assert len(first) == 1, first
    # redrawn each second while she works, and once as she ends: how many redraws a run of a few
    # seconds gets is the machine's load, so one is what is sure
    updates = [m["content"] for m in client.displays if m["msg_type"] == "update_display_data"]
    assert len(updates) >= 1, updates
    assert all(u["transient"]["display_id"] == first[0]["transient"]["display_id"] for u in updates)
    texts = [d["data"]["text/plain"] for d in first + updates]
    assert all(a != b for a, b in zip(texts, texts[1:]))  # an unchanged panel is not sent again
    shown = [o for o in outputs if o.output_type == "display_data"]
    assert len(shown) == 1 and shown[0].data == updates[-1]["data"]
    panel = shown[0].data["text/plain"]
    assert f"dedloc · alice · run {run.name} · state {ROUNDS}" in panel, panel
    assert re.search(r"round \d+ .* \d+/24 \(\d+%\) · (ETA|full)", panel), panel
    assert f"0 pending · {s['samples_uploaded']} uploaded ({s['shards']} shards, {ROUNDS} rounds) · " \
           f"{s['samples_counted']} counted" in panel, panel
    assert re.search(r"speed +\d+\.\d samples/s yours", panel) and "traffic  ↑ " in panel, panel
    assert shown[0].data["text/html"].startswith("<pre") and "\x1b" not in panel

    # the control: no plain progress lines; stdout is the summary alone
    stdout = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
    assert stdout == summary_text(s) + "\n", stdout
    # stderr: the log lines asked for, nothing else (no warning)
    stderr = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stderr")
    lines = stderr.splitlines()
    assert any("uploaded 24 samples to round" in ln for ln in lines), stderr
    assert all(ln.startswith("INFO dedloc_pipeline.") for ln in lines), stderr
    assert "IProgress" not in stderr and not [o for o in outputs if o.output_type == "error"]
