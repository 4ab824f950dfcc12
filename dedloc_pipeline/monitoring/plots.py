"""Figures of a run's ledger (``dedloc plot``, the HTML report, the pretrain flow's artifacts).

Drawn on matplotlib's Agg canvas directly, without pyplot: no display, and no global figure
state shared by the threads of a flow.
"""

from __future__ import annotations

import io
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# name: (title, y label, value of a round from its history entry, drawn as bars, y axis from 0)
FIGURES = {
    "loss": ("training loss per round", "loss (the median volunteer's)", lambda h: h["loss"],
             False, False),
    "samples_per_s": ("throughput per round", "samples / s (opened → committed)", lambda h: h["samples_per_s"],
                      False, True),
    "contributors": ("active peers per round", "contributing peers", lambda h: h["peers"], True, True),
}


def png(fig: Figure) -> bytes:
    """A figure's PNG bytes, drawn on its own Agg canvas."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def _png(title: str, ylabel: str, points: list[tuple[int, float]], bars: bool, from_zero: bool) -> bytes:
    fig = Figure(figsize=(7, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set(title=title, xlabel="round", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if not points:
        ax.text(0.5, 0.5, "no committed round yet", ha="center", va="center", transform=ax.transAxes)
    elif bars:
        ax.bar(*zip(*points), width=0.8, color="tab:green")
        ax.yaxis.get_major_locator().set_params(integer=True)
    else:
        ax.plot(*zip(*points), marker="o" if len(points) <= 100 else None, markersize=3)
    if points and from_zero:
        ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    return png(fig)


def figure(name: str, history: list[dict]) -> bytes:
    """PNG bytes of FIGURES[name]; rounds without a value (no opening time) are left out."""
    title, ylabel, value, bars, from_zero = FIGURES[name]
    points = [(h["round"], value(h)) for h in history if value(h) is not None]
    return _png(title, ylabel, points, bars, from_zero)


def figures(history: list[dict]) -> dict[str, bytes]:
    return {name: figure(name, history) for name in FIGURES}


def learning(history: list[dict], heldout: list[tuple[int, float]], unigram_entropy: float | None = None) -> bytes:
    """The run's learning against the state (optimizer steps taken). Above: round r's training
    loss, state r's on the samples it was sent (masked LM + sentence order). Below: the held-out
    masked-LM loss of the evaluated states, state 0 being random init, and the unigram entropy:
    below that line the model uses context, not just token frequencies."""
    fig = Figure(figsize=(7, 5.4), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    train = [(h["round"], h["loss"]) for h in history if h.get("loss") is not None]
    top.set(title="learning", ylabel="training loss")
    if train:
        top.plot(*zip(*train), marker="o" if len(train) <= 60 else None, markersize=2)
    bottom.set(xlabel="state (optimizer steps taken)", ylabel="held-out MLM loss")
    if heldout:
        bottom.plot(*zip(*heldout), "s-", color="tab:red", label="held-out (state 0: random init)")
    if unigram_entropy is not None:
        bottom.axhline(unigram_entropy, color="gray", linestyle=":", label="unigram entropy")
    if heldout or unigram_entropy is not None:
        bottom.legend(loc="upper right", fontsize="small")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    return png(fig)


def write(history: list[dict], out: str) -> list[str]:
    """``out/{name}.png`` for each figure; returns the paths."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file: the figures are written into a folder")
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, png in figures(history).items():
        paths.append(os.path.join(out, f"{name}.png"))
        with open(paths[-1], "wb") as f:
            f.write(png)
    return paths
