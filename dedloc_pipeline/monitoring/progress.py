"""What a volunteer sees: its worker's progress while it runs, a Ctrl-C that stops cleanly, and
what it contributed. ``dedloc worker`` and ``dedloc_pipeline.join`` (notebooks) both run here.

The display reads only ``Worker.snapshot()`` (no bucket call) and, once the state passes a round
this peer uploaded to, that round's COMMIT: whether the ledger counted the shards. In a terminal
it is a rich live panel; in a Jupyter kernel the same panel as one cell output updated in place;
elsewhere (a log file, a pipe, ``--plain``) a plain line every few seconds, without escape codes.
"""

from __future__ import annotations

import contextvars
import importlib
import io
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from typing import TYPE_CHECKING

from rich.console import Console
from rich.filesize import decimal
from rich.logging import RichHandler
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

if TYPE_CHECKING:  # the display needs no torch of its own
    from ..protocol.run import Run
    from ..protocol.worker import RoundView, Snapshot, Worker

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # this peer's samples/s: over the last half minute
LIVE_REFRESH_S = 0.25
NOTEBOOK_REFRESH_S = 1.0  # each redraw in a notebook is a message to the frontend
NOTEBOOK_HTML = ('<pre style="white-space:pre;overflow-x:auto;line-height:normal;'
                 "font-family:Menlo,'DejaVu Sans Mono',consolas,'Courier New',monospace\">{code}</pre>")


class StopRequest:
    """When a worker should stop: a first Ctrl-C lets the step under way finish (an upload
    completes, chunks then manifest), a second raises KeyboardInterrupt at once (an upload under
    way is abandoned before its manifest); or another thread sets ``event``.

    The handler only counts presses: setting an Event from a signal handler can deadlock on the
    Event's own lock. Outside the main thread, or where SIGINT is ignored, nothing is installed.
    """

    def __init__(self, event: threading.Event | None = None):
        self.event = event
        self.presses = 0
        self._previous = None

    def __call__(self) -> bool:
        return self.presses > 0 or (self.event is not None and self.event.is_set())

    def _pressed(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.signal(signal.SIGINT, self._previous)  # a third press is the usual KeyboardInterrupt
            raise KeyboardInterrupt

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:
                self._previous = previous if previous is not None else signal.default_int_handler
                signal.signal(signal.SIGINT, self._pressed)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class Ledger:
    """This peer's shards as the COMMITs record them: counted, rejected (why), missed (arrived
    after the round closed) or open (the round is not committed yet). A verdict is final once
    its COMMIT exists, so each COMMIT is read once."""

    def __init__(self, run: Run):
        self.run = run
        self._final: dict[str, tuple[str, str | None]] = {}  # shard key -> (verdict, reason)

    def tally(self, uploads, state: int) -> dict:
        """Samples per verdict over ``uploads`` ((round, key, samples)), given committed ``state``."""
        fold = self.run.config.close.late_shards == "fold"  # a late shard counts one round later
        commits: dict[int, dict | None] = {}
        out = {"counted": 0, "counted_shards": 0, "open": 0, "missed": 0, "rejected": []}
        for r, key, samples in uploads:
            verdict, reason = self._final.get(key) or self._verdict(r, key, fold, state, commits)
            if verdict != "open":
                self._final[key] = (verdict, reason)
            if verdict == "rejected":
                out["rejected"].append({"key": key, "round": r, "samples": samples, "reason": reason})
            else:
                out[verdict] += samples
                out["counted_shards"] += verdict == "counted"
        return out

    def _verdict(self, r: int, key: str, fold: bool, state: int, commits: dict) -> tuple[str, str | None]:
        for s in (r + 1, r + 2) if fold else (r + 1,):
            if s > state:
                return "open", None
            if s not in commits:
                commits[s] = self.run.bucket.read_json(self.run.keys.commit(s))
            c = commits[s]
            if c is None:
                return "open", None
            if any(x["key"] == key for x in c.get("shards", [])):
                return "counted", None
            reason = next((x["reason"] for x in c.get("rejected", []) if x["key"] == key), None)
            if reason is not None:
                return "rejected", reason
        return "missed", None


def in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (Jupyter, Colab, VS Code): an IPython shell with a
    kernel. A terminal IPython has no kernel and gets the terminal's panel."""
    ipython = sys.modules.get("IPython")  # never imported here: a kernel has it already
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


class Display:
    """A worker's progress until closed: a live panel in a terminal; in a notebook the same panel
    as one output redrawn in place every second (no ipywidgets needed); else (or with ``plain``)
    one line every ``every`` seconds. Drawn from its own thread, so it moves while the worker is
    busy in a long upload."""

    def __init__(self, worker: Worker, stop: StopRequest | None = None, plain: bool | None = None,
                 every: float = 10.0, console: Console | None = None):
        self.worker, self.stop = worker, stop
        self.console = console or Console()
        if plain:
            self.mode = "plain"
        elif in_jupyter_kernel():
            self.mode = "notebook"
        elif plain is False or self.console.is_terminal:
            self.mode = "live"
        else:
            self.mode = "plain"
        self.every = every
        self.ledger = Ledger(worker.run)
        self._rates: deque[tuple[float, int]] = deque()
        self._view: tuple[int | None, RoundView | None] = (None, None)
        self._counted: tuple[tuple | None, dict] = (None, {})
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None
        self._handlers: list[logging.Handler] = []
        self._cell = None  # the notebook output, a DisplayHandle
        self._drawn: str | None = None

    def __enter__(self) -> Display:
        if self.mode == "live":
            self._live = Live(console=self.console, auto_refresh=False)
            self._live.start()
            root = logging.getLogger()  # log lines above the panel, not through it
            self._handlers, root.handlers = root.handlers, [RichHandler(console=self.console, show_path=False)]
        elif self.mode == "notebook":  # log lines stay the cell's stderr, below the panel
            from IPython.display import display
            bundle = self.rendered(self.facts())
            self._cell, self._drawn = display(bundle, raw=True, display_id=True), bundle["text/plain"]
        # in the caller's context: a kernel sends this thread's output to the cell that called join
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,),
                                        name="dedloc-display", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=2.0)  # it may be reading a COMMIT: never hold up an exit
        if self._live is not None:
            self._live.stop()
            logging.getLogger().handlers = self._handlers
        if self._cell is not None and not self._thread.is_alive():
            self._draw(self.facts())  # the output keeps the panel as it ended

    def _loop(self) -> None:
        period = {"plain": self.every, "live": LIVE_REFRESH_S, "notebook": NOTEBOOK_REFRESH_S}[self.mode]
        while True:
            facts = self.facts()
            if self._done.is_set():
                return
            self._draw(facts)
            if self._done.wait(period):
                return

    def _draw(self, facts: dict) -> None:
        if self.mode == "plain":
            print(self.line(facts), file=self.console.file, flush=True)
        elif self.mode == "live":
            self._live.update(self.panel(facts), refresh=True)
        else:
            bundle = self.rendered(facts)
            if bundle["text/plain"] != self._drawn:  # an unchanged panel sends nothing
                self._cell.update(bundle, raw=True)
                self._drawn = bundle["text/plain"]

    def rendered(self, facts: dict) -> dict[str, str]:
        """The panel for a notebook output: HTML with rich's colours, and plain text."""
        console = Console(file=io.StringIO(), record=True, width=120, force_jupyter=False)
        console.print(self.panel(facts))
        text = console.export_text(clear=False)
        return {"text/html": console.export_html(inline_styles=True, code_format=NOTEBOOK_HTML),
                "text/plain": text}

    # what to show
    def facts(self) -> dict:
        """Everything shown, from one snapshot (and the ledger once the state moved)."""
        s = self.worker.snapshot()
        now = time.monotonic()
        self._rates.append((now, s.computed))
        while len(self._rates) > 2 and now - self._rates[0][0] > RATE_WINDOW_S:
            self._rates.popleft()
        t0, c0 = self._rates[0]
        mine_per_s = (s.computed - c0) / (now - t0) if now > t0 else 0.0
        if s.view is not None:
            self._view = (s.state, s.view)
        view = self._view[1] if self._view[0] == s.state and s.state is not None else None
        manifest = view.manifest_samples if view else 0
        others = view.fresh_samples if view else 0
        mine = s.pending if s.round == s.state else 0
        full = view is not None and (view.closed or manifest >= s.target)
        others_per_s = view.samples_per_s if view else 0.0
        remaining = max(0, s.target - manifest - others - mine)
        speed = mine_per_s + others_per_s
        if full or view is None or (remaining and speed <= 0):
            eta = None
        else:
            eta = remaining / speed if remaining else 0.0
        done = (s.state, len(s.uploads))
        if self._counted[0] != done and s.state is not None:
            try:
                self._counted = (done, self.ledger.tally(s.uploads, s.state))
            except Exception as exc:  # a bucket hiccup: asked again next time, the display lives on
                log.warning("%s: the ledger could not be read (%s)", s.peer, exc)
        return {"snapshot": s, "activity": self._activity(s, full), "manifest": manifest, "others": others,
                "mine": mine, "full": full, "peers": view.peers if view else 0, "eta_s": eta,
                "mine_per_s": mine_per_s, "others_per_s": others_per_s,
                "counted": self._counted[1].get("counted", 0),
                "rounds": len({r for r, _, _ in s.uploads})}

    def _activity(self, s: Snapshot, full: bool) -> str:
        if self.stop is not None and self.stop():
            what = f"finishing the upload to round {s.round}" if s.activity == "uploading" else "finishing a step"
            again = " (interrupt again to quit at once)" if self.stop.presses else ""
            return f"stopping: {what}, then leaving{again}"
        if s.activity == "starting":
            return "pulling the latest state"
        if s.activity == "uploading":
            return f"uploading {s.pending} samples to round {s.round}"
        if s.activity == "waiting" or (full and s.pending == 0):
            return f"round {s.state} is full: waiting for state {s.state + 1}"
        if s.round is not None and s.state is not None and s.round > s.state:
            return f"round {s.state} is full: computing round {s.round} ahead"
        return f"computing round {s.state}"

    def line(self, f: dict) -> str:
        """The plain form: one line, no escape codes."""
        s = f["snapshot"]
        total = f["manifest"] + f["others"] + f["mine"]
        if s.state is None:
            return f"{time.strftime('%H:%M:%S')} {s.peer}: joining run {self.worker.run.name}, {f['activity']}"
        return (f"{time.strftime('%H:%M:%S')} {s.peer} state {s.state}: {f['activity']} | "
                f"round {s.state} {total}/{s.target} ({_percent(total, s.target)}) {_eta(f)} | "
                f"you: {s.pending} pending, {s.uploaded} uploaded in {len(s.uploads)} shards, "
                f"{f['counted']} counted | {f['mine_per_s']:.1f} samples/s "
                f"(others {f['others_per_s']:.1f}, {f['peers']} peers) | "
                f"up {decimal(s.bytes_up)} down {decimal(s.bytes_down)}")

    def panel(self, f: dict) -> Panel:
        """The live form, for 80 columns and up."""
        s = f["snapshot"]
        total = f["manifest"] + f["others"] + f["mine"]
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=s.target, completed=min(total, s.target), width=30),
                    f"{total}/{s.target} ({_percent(total, s.target)}) · {_eta(f)}")
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("now", f["activity"])
        if s.state is not None:
            grid.add_row(f"round {s.state}", bar)
            grid.add_row("", f"{f['manifest']} in shards · {f['others']} pending at {f['peers']} other "
                             f"peers · {f['mine']} yours")
        grid.add_row("you", f"{s.pending} pending · {s.uploaded} uploaded ({len(s.uploads)} shards, "
                            f"{f['rounds']} rounds) · {f['counted']} counted")
        grid.add_row("speed", f"{f['mine_per_s']:.1f} samples/s yours · {f['others_per_s']:.1f} the others'")
        grid.add_row("traffic", f"↑ {decimal(s.bytes_up)}  ↓ {decimal(s.bytes_down)}")
        title = f"dedloc · {s.peer} · run {self.worker.run.name}"
        title += "" if s.state is None else f" · state {s.state}"
        return Panel(grid, title=title, title_align="left", expand=False)


def _percent(n: int, target: int) -> str:
    return f"{100 * n / target:.0f}%" if target else "-"


def _eta(f: dict) -> str:
    if f["full"]:
        return "full: reducing"
    return "ETA unknown" if f["eta_s"] is None else f"ETA {timedelta(seconds=round(f['eta_s']))}"


# what the volunteer did
def summary(worker: Worker, ended: str, ledger: Ledger | None = None) -> dict:
    """What this session contributed. With a ledger, the COMMITs say what counted (a few bucket
    reads); without (a second Ctrl-C), only what was uploaded."""
    s = worker.snapshot()
    out = {"peer": s.peer, "run": worker.run.name, "state": s.state, "ended": ended,
           "samples_uploaded": s.uploaded, "shards": len(s.uploads),
           "rounds": len({r for r, _, _ in s.uploads}), "samples_computed": s.computed,
           "seconds": time.monotonic() - worker.started, "bytes_up": s.bytes_up, "bytes_down": s.bytes_down}
    if ledger is not None:
        t = ledger.tally(s.uploads, worker.run.latest() if s.uploads else -1)
        out.update(samples_counted=t["counted"], shards_counted=t["counted_shards"], samples_open=t["open"],
                   samples_missed=t["missed"], rejected=t["rejected"])
    return out


ENDED = {"until_round": "state reached", "run_stopped": "the organizer stopped the run",
         "stop_requested": "asked to stop", "ctrl_c": "stopped cleanly after Ctrl-C",
         "interrupted": "interrupted"}


def summary_text(s: dict) -> str:
    lines = [f"{s['peer']}: stopped at state {s['state']} ({ENDED[s['ended']]}); "
             f"in {timedelta(seconds=round(s['seconds']))} this session:",
             f"  uploaded  {s['samples_uploaded']} samples in {s['shards']} shards to {s['rounds']} rounds",
             f"  computed  {s['samples_computed']} samples; traffic {decimal(s['bytes_up'])} up, "
             f"{decimal(s['bytes_down'])} down"]
    if "samples_counted" not in s:
        lines.append("  counted   not looked up (interrupted)")
        return "\n".join(lines)
    lines.append(f"  counted   {s['samples_counted']} samples ({s['shards_counted']} shards) in committed "
                 "states")
    if s["samples_open"]:
        lines.append(f"  open      {s['samples_open']} samples in rounds not committed yet")
    if s["samples_missed"]:
        lines.append(f"  missed    {s['samples_missed']} samples arrived after their round closed")
    for x in s["rejected"]:
        lines.append(f"  rejected  {x['samples']} samples in round {x['round']}: {x['reason']}")
    return "\n".join(lines)


def volunteer(worker: Worker, until_round: int | None = None, event: threading.Event | None = None,
              plain: bool | None = None, every: float = 10.0, console: Console | None = None) -> dict:
    """Serve with a display until ``until_round``, the run's STOP, ``event`` or Ctrl-C; then
    leave and return the summary (``ended`` says which)."""
    stop, interrupted = StopRequest(event), False
    with stop, Display(worker, stop, plain, every, console) as display:
        try:
            state = worker.serve(until_round, stop)
        except KeyboardInterrupt:
            state, interrupted = worker.state, True
    if interrupted:
        ended = "interrupted"
    elif stop.presses:
        ended = "ctrl_c"
    elif worker.stopped:
        ended = "run_stopped"
    elif until_round is not None and state is not None and state >= until_round:
        ended = "until_round"
    else:
        ended = "stop_requested"
    return summary(worker, ended, None if interrupted else display.ledger)


def _import_tqdm_auto() -> None:
    """transformers and huggingface_hub import ``tqdm.auto``, which in a kernel without ipywidgets
    warns "IProgress not found" and falls back to tqdm's console bars. A worker shows none of
    their bars, so that one warning only alarms a volunteer: import it first without it."""
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        importlib.import_module("tqdm.auto")


def make_worker(bucket: str, run: str, peer_id: str | None = None, key: str | None = None,
                device: str | None = None, micro_batch: int | None = None, threads: int | None = None,
                poll: float | None = None, endpoint_url: str | None = None, precision: str = "fp32") -> Worker:
    """A volunteer's worker, checked before any model is built: a usable peer id, a device that
    exists (default: the GPU when there is one), the key it signs with."""
    _import_tqdm_auto()
    from ..protocol.run import Run
    from ..protocol.worker import Worker
    from ..storage.bucket import Bucket
    from ..storage.layout import PEER_ID, is_name
    from ..trust import identity

    if peer_id is not None and not is_name(peer_id):
        raise ValueError(f"peer id {peer_id!r} must match {PEER_ID}")
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device on this machine (use --device cpu)")
    signer = identity.load(os.path.expanduser(key)) if key else None
    return Worker(Run(Bucket(bucket, endpoint_url=endpoint_url), run), peer_id, micro_batch, threads,
                  poll_s=poll, device=device, signer=signer, precision=precision)
