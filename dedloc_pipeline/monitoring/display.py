"""What a volunteer sees while its worker runs: a rich live panel in a terminal; in a Jupyter kernel
the same panel as one cell output updated in place; elsewhere (a log file, a pipe, ``--plain``) a
plain line every few seconds, without escape codes.

The display reads only ``Worker.snapshot()`` (no bucket call) and, once the state passes a round
this peer uploaded to, that round's COMMIT (``Uploads``): whether the ledger counted the shards.
Its time is the worker's clock; its ETA is the round view's (``protocol.view.eta``).
"""

from __future__ import annotations

import contextvars
import io
import logging
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from typing import TYPE_CHECKING

from rich.console import Console
from rich.filesize import decimal
from rich.live import Live
from rich.logging import RichHandler
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from ..protocol import view as published
from .stop import StopRequest
from .uploads import Uploads

if TYPE_CHECKING:  # the display needs no torch of its own
    from ..volunteer.worker import Progress, RoundView, Worker

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # this peer's samples/s: over the last half minute
LIVE_REFRESH_S = 0.25
NOTEBOOK_REFRESH_S = 1.0  # each redraw in a notebook is a message to the frontend
NOTEBOOK_HTML = ('<pre style="white-space:pre;overflow-x:auto;line-height:normal;'
                 "font-family:Menlo,'DejaVu Sans Mono',consolas,'Courier New',monospace\">{code}</pre>")



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
                 every: float = 10.0, console: Console | None = None, role=None):
        """``role``: this volunteer's aggregator role (``AggregatorRole``), whose work it shows too."""
        self.worker, self.stop, self.role = worker, stop, role
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
        self.ledger = Uploads(worker.run)
        self._rates: deque[tuple[float, int]] = deque()
        self._view: tuple[int | None, RoundView | None, float] = (None, None, 0.0)  # state, view, when read
        self._open: tuple[int | None, RoundView | None, float] = (None, None, 0.0)  # the last one not closed
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
        now = self.worker.clock.monotonic()
        self._rates.append((now, s.computed))
        while len(self._rates) > 2 and now - self._rates[0][0] > RATE_WINDOW_S:
            self._rates.popleft()
        t0, c0 = self._rates[0]
        mine_per_s = (s.computed - c0) / (now - t0) if now > t0 else 0.0
        if s.view is not None:
            self._view = (s.state, s.view, now - (s.view_age_s or 0.0))
            if not s.view.closed:
                self._open = self._view
        view = self._view[1] if self._view[0] == s.state and s.state is not None else None
        read_at = self._view[2] if view is not None else None
        # the others: a closed view counts only those already heartbeating the next round at its
        # CLOSE, so while the round is reduced they are shown as the round's last open view had them
        seen, seen_at = view, read_at
        if view is not None and view.closed and self._open[0] == s.state and \
                self._open[1].peers + self._open[1].ahead_peers > view.peers + view.ahead_peers:
            seen, seen_at = self._open[1], self._open[2]
        # this peer's own shards count in the round even where the view in hand is older than them
        manifest = max(view.manifest_samples if view else 0, sum(n for r, _, n in s.uploads if r == s.state))
        others = view.fresh_samples if view else 0
        mine = s.pending if s.round == s.state else 0
        full = s.fetching is not None or view is not None and (view.closed or manifest >= s.target)
        speed = mine_per_s + (view.samples_per_s if view else 0.0)  # toward this round: the ETA's
        others_per_s = seen.samples_per_s + seen.ahead_samples_per_s if seen else 0.0  # ahead ones too
        eta = None if view is None else published.eta(s.target, manifest, others + mine, speed, full)
        done = (s.state, len(s.uploads))
        if self._counted[0] != done and s.state is not None:
            try:
                self._counted = (done, self.ledger.tally(s.uploads, s.state))
            except Exception as exc:  # a bucket hiccup: asked again next time, the display lives on
                log.warning("%s: the ledger could not be read (%s)", s.peer, exc)
        return {"snapshot": s, "activity": self._activity(s, full), "manifest": manifest, "others": others,
                "mine": mine, "full": full, "peers": seen.peers + seen.ahead_peers if seen else 0, "eta_s": eta,
                "mine_per_s": mine_per_s, "others_per_s": others_per_s,
                "counted": self._counted[1].get("counted", 0),
                "rounds": len({r for r, _, _ in s.uploads}), "aggregated": self._aggregated(),
                "as_of": "" if seen_at is None else f", as of {now - seen_at:.0f} s ago"}

    def _aggregated(self) -> str | None:
        """What this volunteer did as an aggregator: parts computed and revealed, and the last round."""
        if self.role is None:
            return None
        done = list(self.role.done.values())
        last = f", last in round {max(d.round for d in done)}" if done else ""
        return f"{len(done)} parts computed, {sum(d.revealed for d in done)} revealed{last}"

    def _activity(self, s: Progress, full: bool) -> str:
        if self.stop is not None and self.stop():
            what = f"finishing the upload to round {s.round}" if s.activity == "uploading" else "finishing a step"
            again = " (interrupt again to quit at once)" if self.stop.presses else ""
            return f"stopping: {what}, then leaving{again}"
        if s.activity == "starting":
            return "pulling the latest state"
        if s.scheduler is not None:  # nobody is closing rounds: say so before what this peer does meanwhile
            doing = "waiting" if s.activity == "waiting" else f"computing round {s.round}, holding its samples"
            return f"{s.scheduler}: {doing}"
        if s.activity == "uploading":
            return f"uploading {s.pending} samples to round {s.round}"
        if s.fetching is not None:
            ahead = f", computing round {s.round} meanwhile" if s.round is not None and s.round > s.state else ""
            return f"state {s.fetching} committed: downloading it{ahead}"
        if s.activity == "waiting" or (full and s.pending == 0):
            return f"round {s.state} is full: waiting for state {s.state + 1}"
        if s.round is not None and s.state is not None and s.round > s.state:
            return f"round {s.state} is full: computing round {s.round} ahead"
        return f"computing round {s.state}"

    def line(self, f: dict) -> str:
        """The plain form: one line, no escape codes."""
        s = f["snapshot"]
        total = f["manifest"] + f["others"] + f["mine"]
        at = time.strftime("%H:%M:%S", time.localtime(self.worker.clock.time()))
        if s.state is None:
            return f"{at} {s.peer}: joining run {self.worker.run.name}, {f['activity']}"
        return (f"{at} {s.peer} state {s.state}: {f['activity']} | "
                f"round {s.state} {total}/{s.target} ({_percent(total, s.target)}) {_eta(f)} | "
                f"you: {s.pending} pending, {s.uploaded} uploaded in {len(s.uploads)} shards, "
                f"{f['counted']} counted | {f['mine_per_s']:.1f} samples/s "
                f"(others {f['others_per_s']:.1f}, {f['peers']} peers{f['as_of']}) | "
                f"up {decimal(s.bytes_up)} down {decimal(s.bytes_down)}"
                + (f" | aggregator: {f['aggregated']}" if f["aggregated"] else ""))

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
                             f"peers{f['as_of']} · {f['mine']} yours")
        grid.add_row("you", f"{s.pending} pending · {s.uploaded} uploaded ({len(s.uploads)} shards, "
                            f"{f['rounds']} rounds) · {f['counted']} counted")
        grid.add_row("speed", f"{f['mine_per_s']:.1f} samples/s yours · {f['others_per_s']:.1f} the others'")
        grid.add_row("traffic", f"↑ {decimal(s.bytes_up)}  ↓ {decimal(s.bytes_down)}")
        if f["aggregated"]:
            grid.add_row("aggregator", f["aggregated"])
        title = f"dedloc · {s.peer} · run {self.worker.run.name}"
        title += "" if s.state is None else f" · state {s.state}"
        return Panel(grid, title=title, title_align="left", expand=False)


def _percent(n: int, target: int) -> str:
    return f"{100 * n / target:.0f}%" if target else "-"


def _eta(f: dict) -> str:
    if f["snapshot"].fetching is not None:
        return "closed"
    if f["snapshot"].scheduler is not None:  # nobody closes or reduces it: no ETA, and no "reducing"
        return "no scheduler"
    if f["full"]:
        return "full: reducing"
    return "ETA unknown" if f["eta_s"] is None else f"ETA {timedelta(seconds=round(f['eta_s']))}"

