"""Monitoring a collaboration: `dedloc status`, `plot` and `report` against the ledger (the COMMITs),
with hostile strings in the places volunteers write (heartbeats, evaluation results)."""

from __future__ import annotations

import base64
import json
import re
import time
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.monitoring import report
from dedloc_pipeline.monitoring.status import status
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol import view
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import collaborate, written

from .conftest import small_config

ROUNDS = 3
PEERS = [("ann", 4), ("bob", 8), ("cy", 4)]
XSS_PEER = "<img src=x onerror=alert(1)>"  # a prefix named so holds no heartbeat anyone reads: not a peer id
XSS_TASK = "<script>alert('task')</script>"
PNG = b"\x89PNG\r\n\x1a\n"


def cli(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def collab(tmp_path_factory):
    """ROUNDS committed rounds from three peers; then the open round's heartbeats replaced by known
    ones (two hostile), an unreadable heartbeat, a manifest claiming samples no shard holds, the
    scheduler's round view of it all, and two evaluation results (one hostile)."""
    url = f"file://{tmp_path_factory.mktemp('monitoring')}/bucket"
    run = init_run(Bucket(url), small_config("mon-run"))
    collaborate(run, PEERS, ROUNDS)
    keys, bucket, now = run.keys, run.bucket, time.time()
    beats = {"ann": (4, 2.0), "bob": (0, 3.0), "dee": (2, 1.0)}
    for old in written(run, ROUNDS, "progress"):
        bucket.delete(old)
    for peer, (samples, rate) in beats.items():
        bucket.write_json(keys.progress(ROUNDS, peer), {"peer": "someone-else", "round": ROUNDS, "samples": samples,
                                                        "samples_per_s": rate, "time": now})
    bucket.write_bytes(keys.progress(ROUNDS, "broken"), b"{not json")
    bucket.write_json(keys.progress(ROUNDS, XSS_PEER), {"peer": XSS_PEER, "round": ROUNDS, "samples": 2,
                                                        "samples_per_s": 1.0, "time": now})
    uploaded = sum(bucket.read_json(k)["samples"] for k in written(run, ROUNDS))
    bucket.write_json(keys.manifest(keys.shard(ROUNDS, "liar", "0")), {"samples": 1000})
    Scheduler(run, 1, 0).try_close(ROUNDS)  # validates the manifests, counts the heartbeats: the view
    bucket.write_json(keys.eval(ROUNDS, "mlm-heldout"), {
        "state": ROUNDS, "task": "mlm-heldout", "dataset": "synthetic held-out split", "loss": 5.25,
        "random_init_loss": 9.0})
    bucket.write_json(keys.eval(ROUNDS, "ner"), {
        "state": ROUNDS, "task": XSS_TASK, "source": "a&b", "metric": "f1",
        "pretrained": {"test": "<b>bold</b>"}, "random_init": {"test": 0.5}})
    commits = [run.commit_of(s) for s in range(1, ROUNDS + 1)]
    return url, run, commits, beats, uploaded


def test_status_equals_the_ledger(collab):
    _, run, commits, beats, uploaded = collab
    s = status(run)
    assert s["round"] == ROUNDS and [h["round"] for h in s["history"]] == list(range(ROUNDS))
    for h, c in zip(s["history"], commits):
        assert (h["samples"], h["loss"], h["contributors"]) == (c["samples"], c["loss"], c["contributors"])
        assert h["peers"] == len(set(c["contributors"])) >= 2
        began = c["started_at"] or c["opened_at"]  # the first work the scheduler saw on it
        assert c["opened_at"] <= began < c["committed_at"]
        assert h["duration_s"] == pytest.approx(c["committed_at"] - began) and h["duration_s"] > 0
        assert h["samples_per_s"] == pytest.approx(c["samples"] / h["duration_s"])
        assert h["settled_s"] == pytest.approx(c["committed_at"] - c["closed_at"]) and h["stages"] == c["stages"]
        assert sum(h["stages"].values()) <= h["settled_s"] + 1e-6  # the organizer's steps from CLOSE to COMMIT
    board = {p["peer_id"]: p for p in s["peers"]}
    assert set(board) == {name for name, _ in PEERS} | set(beats)  # "broken" is skipped, XSS_PEER never read
    for name, _ in PEERS:
        mine = [sh for c in commits for sh in c["shards"] if sh["peer"] == name]
        assert board[name]["samples"] == sum(sh["samples"] for sh in mine) > 0
        assert board[name]["rounds"] == sum(name in c["contributors"] for c in commits) > 0
    assert board["dee"]["samples"] == 0 and board["dee"]["live"]
    assert sum(p["samples"] for p in s["peers"]) == sum(c["samples"] for c in commits)
    assert [p["samples"] for p in s["peers"]] == sorted((p["samples"] for p in s["peers"]), reverse=True)

    p = s["progress"]  # the liar's claim is no validated sample
    assert p["uploaded_samples"] == uploaded and view.read(run.bucket, run.keys).rejected == 1
    assert p["samples"] == uploaded + sum(n for n, _ in beats.values()) and p["peers"] == len(beats)
    assert p["samples_per_s"] == pytest.approx(sum(r for _, r in beats.values()))
    assert p["target"] == 24 and p["fraction"] == pytest.approx(min(1.0, p["samples"] / 24))
    if not p["closed"] and p["samples"] < 24:
        assert p["eta_s"] == pytest.approx((24 - p["samples"]) / p["samples_per_s"])
    # long after the heartbeats: nobody is live, nothing pending, no ETA
    later = status(run, now=time.time() + 10 * run.config.peer_timeout_s)["progress"]
    assert later["peers"] == 0 and later["samples"] == uploaded and later["samples_per_s"] == 0
    assert later["eta_s"] == (0.0 if later["closed"] or uploaded >= 24 else None)


def test_status_says_who_is_live_not_one_that_left_and_one_computing_ahead(make_run):
    """The report: `status` listed volunteers that had left cleanly as live for about 30 s, and
    said 0 live peers while two computed during a reduce. A heartbeat that says the peer left is
    not live; one of the next round (computing ahead) is, in the board and in the open round."""
    run = make_run()
    collaborate(run, [("ann", 4), ("bob", 4)], 1)
    r, keys, now = run.latest(), run.keys, time.time()
    for old in written(run, r, "progress") + written(run, r + 1, "progress"):
        run.bucket.delete(old)
    run.bucket.write_json(keys.progress(r, "ann"), {"peer": "ann", "round": r, "samples": 0, "samples_per_s": 0.0,
                                                    "time": now, "left": True})
    run.bucket.write_json(keys.progress(r + 1, "bob"), {"peer": "bob", "round": r + 1, "samples": 4,
                                                        "samples_per_s": 2.0, "time": now})
    Scheduler(run, 1, 0).try_close(r)
    s = status(run, now=now)
    board = {p["peer_id"]: p for p in s["peers"]}
    assert (board["ann"]["live"], board["bob"]["live"]) == (False, True)
    assert s["progress"]["peers"] == 1


def test_status_command(collab):
    url, run, commits, _, _ = collab
    out = cli("status", "--bucket", url, "--run", run.name).stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"run mon-run: state {ROUNDS}, round {ROUNDS} at ")
    assert any(ln.startswith(f"open round {ROUNDS}") and "%" in ln and ("ETA" in ln or "closed" in ln) for ln in lines)
    for c in commits:
        row = next(ln for ln in lines if ln.split(":")[0].split() == ["round", str(c["round"])])
        assert f"loss {c['loss']:.4f}" in row and f"{c['samples']} samples" in row
        assert f"{len(set(c['contributors']))} contributors" in row
    s = status(run)
    for p in s["peers"]:  # the leaderboard: a row per peer with its samples and rounds
        seen = "live" if p["live"] else ".* ago"
        row = rf"^\s*{re.escape(p['peer_id'])}\s+{p['samples']:,}\s+{p['rounds']}\s+{p['aggregated']}\s+{seen}\s*$"
        assert any(re.match(row, ln) for ln in lines), (row, out)

    s = json.loads(cli("status", "--bucket", url, "--run", run.name, "--json").stdout)
    assert {"target", "fraction", "samples_per_s", "eta_s"} <= s["progress"].keys()
    assert [h["samples_per_s"] for h in s["history"]] == pytest.approx(
        [c["samples"] / (c["committed_at"] - (c["started_at"] or c["opened_at"])) for c in commits])


def test_plot_writes_pngs(collab, tmp_path):
    import matplotlib.image
    url, run, _, _, _ = collab
    out = cli("plot", "--bucket", url, "--run", run.name, "--out", str(tmp_path / "figs")).stdout.split()
    assert sorted(p.rsplit("/", 1)[-1] for p in out) == ["contributors.png", "loss.png", "samples_per_s.png"]
    for path in out:
        data = open(path, "rb").read()
        assert data.startswith(PNG) and len(data) > 1000
        img = matplotlib.image.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100


class Page(HTMLParser):
    """What the report is made of: table rows by table id, the images, the text."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {}
        self.imgs: list[dict] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self._table = self._cell = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "table":
            self._table = self.rows.setdefault(a.get("id"), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.imgs.append(a)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def test_report_page(collab, tmp_path):
    url, run, commits, beats, _ = collab
    path = tmp_path / "report.html"
    res = cli("report", "--bucket", url, "--run", run.name, "--out", str(path), "--upload")
    assert run.keys.report() in res.stdout
    html = path.read_text(encoding="utf-8")
    assert Bucket(url).read_bytes(run.keys.report()) == html.encode("utf-8")

    page = Page()
    page.feed(html)
    page.close()
    assert page.tags.count("script") == 0  # the hostile strings are text, not elements
    assert len(page.imgs) == 3 == page.tags.count("img")
    for img in page.imgs:
        assert img["src"].startswith("data:image/png;base64,") and img["alt"]
        assert base64.b64decode(img["src"].split(",", 1)[1]).startswith(PNG)
    for raw in (XSS_TASK, "<b>bold</b>"):
        assert raw not in html and raw in "".join(page.text)
    assert XSS_PEER not in "".join(page.text)  # off the layout: never read

    s = status(run)
    header, *board = page.rows["leaderboard"]
    assert header == ["peer", "samples counted", "rounds contributed", "parts aggregated", "last seen"]
    assert [row[0] for row in board] == [p["peer_id"] for p in s["peers"]]
    for row, p in zip(board, s["peers"]):
        assert row[1:3] == [f"{p['samples']:,}", str(p["rounds"])]
    header, *rounds = page.rows["rounds"]
    assert [row[0] for row in rounds] == [str(c["round"]) for c in commits]
    for row, c in zip(rounds, commits):
        assert row[1] == f"{c['loss']:.4f}" and row[2] == f"{c['samples']:,}"
        assert row[3] == f"{len(set(c['contributors']))}: " + ", ".join(sorted(set(c["contributors"])))
    _, *evals = page.rows["evals"]
    assert sorted(tuple(row[1:6]) for row in evals) == sorted([
        ("mlm-heldout", "synthetic held-out split", "loss (lower is better)", "5.2500", "9.0000"),
        (XSS_TASK, "a&b", "f1", "<b>bold</b>", "0.5000")])


def test_a_run_not_going_on_says_so_and_a_long_run_keeps_its_rounds_table_short(collab):
    """The report: a finished or stopped run's page showed "Open round ... 0 live peers, ETA
    unknown" and never said the run ended; with 355 rounds its table made the page very long."""
    _, run, _, _, _ = collab
    s = status(run)
    page = Page()
    page.feed(report.render(run, dict(s, history=[dict(s["history"][0], round=i) for i in range(120)])))
    _, *rows = page.rows["rounds"]
    assert [row[0] for row in rows] == [str(i) for i in range(120 - report.ROUNDS_SHOWN, 120)]
    assert f"The newest {report.ROUNDS_SHOWN} of 120 rounds" in "".join(page.text)
    for ended, line in ((dict(s, stopped=True), "stopped: STOP.json is in the run"),
                        (dict(s, progress=dict(s["progress"], scheduler_ended="the run is stopped (dedloc stop)")),
                         "no scheduler: the run is stopped (dedloc stop); start one")):
        page = Page()
        page.feed(report.render(run, ended))
        text = "".join(page.text)
        assert "The run is not going on" in text and line in text and "Open round" not in text, text


def test_flow_summary_markdown(collab):
    _, run, commits, _, _ = collab
    md = report.markdown(status(run), "s3://b/runs/mon-run/report/index.html")
    uri = md.split("](data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(uri).startswith(PNG)
    assert "s3://b/runs/mon-run/report/index.html" in md
    assert all(f"| {c['round']} | {c['loss']:.4f} | {c['samples']} |" in md for c in commits)
    rows = report.leaderboard_rows(status(run))
    assert {r["peer"]: r["samples counted"] for r in rows}["ann"] == sum(
        sh["samples"] for c in commits for sh in c["shards"] if sh["peer"] == "ann")


def test_report_renders_in_headless_chromium(collab, tmp_path):
    """What a browser shows: Debian's chromium renders the page (scripts blocked by its CSP),
    the DOM it ends with holds the tables and images, and the screenshot is not blank."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium is installed by `make install` (Debian's package)"
    url, run, commits, _, _ = collab
    page = tmp_path / "report.html"
    cli("report", "--bucket", url, "--run", run.name, "--out", str(page))
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    shown = Page()
    shown.feed(dom.stdout)
    assert len(shown.imgs) == 3 and shown.tags.count("script") == 0
    assert [row[0] for row in shown.rows["rounds"][1:]] == [str(c["round"]) for c in commits]
    assert XSS_TASK in "".join(shown.text)  # shown as text
    shot = tmp_path / "shot.png"
    res = subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    assert res.returncode == 0 and shot.read_bytes().startswith(PNG), res.stderr[-2000:]
    import matplotlib.image
    pixels = matplotlib.image.imread(shot)
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 20  # figures drawn
