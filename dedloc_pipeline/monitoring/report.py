"""One static HTML page of a run (``dedloc report``), for the organizer to publish.

Self-contained (figures inline as base64 PNG, styles inline, no script), so it can be served from
the bucket or mailed as a file. Every string in it that comes from the bucket (peer ids, heartbeat
and evaluation fields) is escaped: volunteers write much of what is shown.
"""

from __future__ import annotations

import base64
import datetime
import json
from html import escape

from ..protocol.clock import duration
from ..protocol.run import Run
from . import plots
from .status import damaged_line, scheduler_line, status

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; }
th, td { padding: 0.25rem 0.75rem; border-bottom: 1px solid #ddd; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 0 0 1rem; } img { max-width: 100%; }
.bar { background: #eee; width: 20rem; height: 0.8rem; display: inline-block; }
.bar span { background: #4a4; height: 100%; display: block; }
"""
# the page needs nothing from anywhere: a stray tag in a field could not load or run anything
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

LEADERBOARD = ("peer", "samples counted", "rounds contributed", "parts aggregated", "last seen")
ROUNDS_SHOWN = 50  # the rounds table's newest rows; the figures show every round
FIGURE_ALT = {"loss": "loss per round", "samples_per_s": "samples per second per round",
              "contributors": "active peers per round"}


def _when(t) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def _num(x, fmt: str = ".4f") -> str:
    """A number as ``fmt``; anything else (an evaluation file is anyone's JSON) as its text."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, fmt)
    return "" if x is None else str(x)


def _table(tid: str, header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """A table whose every cell is escaped here, the one place cells become HTML."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td class=\"n\">{escape(c)}</td>" if i in numeric else f"<td>{escape(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>\n" for row in rows)
    return f'<table id="{tid}"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>'


def evals(run: Run) -> list[dict]:
    """Every evaluation result under ``runs/RUN/evals/``, by state then task; unreadable ones skipped."""
    found = run.bucket.read_many(run.bucket.find(run.keys.evals_dir))
    results = []
    for key in sorted(found):
        try:
            res = json.loads(found[key])
        except (TypeError, ValueError):
            continue
        if isinstance(res, dict):
            results.append(res)
    return results


def _eval_row(res: dict) -> list[str]:
    """state, task, data, metric, pretrained, random init: both result shapes of ``evaluation``."""
    def pick(d, k):
        return d.get(k) if isinstance(d, dict) else None
    if "pretrained" in res:
        return [_num(res.get("state"), ""), _num(res.get("task")), _num(res.get("source")), _num(res.get("metric")),
                _num(pick(res["pretrained"], "test")), _num(pick(res.get("random_init"), "test"))]
    return [_num(res.get("state"), ""), _num(res.get("task")), _num(res.get("dataset")), "loss (lower is better)",
            _num(res.get("loss")), _num(res.get("random_init_loss"))]


def leaderboard_rows(s: dict) -> list[dict]:
    """The contributors' leaderboard as plain rows (the report, the pretrain flow's table artifact)."""
    return [dict(zip(LEADERBOARD, (q["peer_id"], q["samples"], q["rounds"], q["aggregated"],
                                   _when(q["last_seen"]) if q["last_seen"] else "never"))) for q in s["peers"]]


def render(run: Run, s: dict | None = None) -> str:
    """The page: the open round (or that the run is not going on, and why), the figures, the
    leaderboard, the newest ``ROUNDS_SHOWN`` closed rounds, the evaluations."""
    s = status(run) if s is None else s
    p, cfg = s["progress"], run.config
    figs = "\n".join(
        f'<figure><img alt="{escape(FIGURE_ALT[name])}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"</figure>" for name, png in plots.figures(s["history"]).items())
    leaders = _table("leaderboard", list(LEADERBOARD),
                     [[f"{v:,}" if isinstance(v, int) else v for v in row.values()] for row in leaderboard_rows(s)],
                     numeric={1, 2, 3})
    rounds = _table("rounds", ["round", "loss", "samples", "contributors", "rejected shards", "duration",
                               "samples/s", "committed"],
                    [[str(h["round"]), _num(h["loss"]), f"{h['samples']:,}",
                      f"{h['peers']}: " + ", ".join(sorted(set(h["contributors"]))), str(h["rejected"]),
                      duration(h["duration_s"]), _num(h["samples_per_s"], ".1f"), _when(h["committed_at"])]
                     for h in s["history"][-ROUNDS_SHOWN:]], numeric={0, 1, 2, 4, 6})
    if len(s["history"]) > ROUNDS_SHOWN:
        rounds = (f"<p>The newest {ROUNDS_SHOWN} of {len(s['history'])} rounds (every one: "
                  f"<code>dedloc status --json</code>).</p>\n{rounds}")
    results = evals(run)
    eval_section = (_table("evals", ["state", "task", "data", "metric", "pretrained", "random init"],
                           [_eval_row(r) for r in results], numeric={0, 4, 5})
                    if results else "<p>No evaluation yet (<code>dedloc eval</code>).</p>")
    eta = ("closed, being reduced" if p["closed"] else
           f"ETA {duration(p['eta_s'])}" if p["eta_s"] is not None else "ETA unknown")
    if s["stopped"] or p["scheduler_ended"]:  # no round is open: say why, and how to go on
        now = f"""<h2>The run is not going on</h2>
<p id="progress">{escape(scheduler_line(s))}</p>"""
    else:
        now = f"""<h2>Open round</h2>
<p id="progress">{escape(f"round {p['round']}: {p['samples']}/{p['target']} samples")}
<span class="bar"><span style="width: {100 * p['fraction']:.0f}%"></span></span>
{escape(f"{100 * p['fraction']:.0f}% from {p['peers']} live peers at {p['samples_per_s']:.1f} samples/s, {eta}")}</p>
<p id="scheduler">{escape(scheduler_line(s))}</p>"""
    title = escape(f"run {s['run']}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{STYLE}</style></head>
<body>
<h1>{title}</h1>
<p>{escape(f"state {s['round']} committed; {cfg.preset} model ({_num(s['n_params'], ',')} parameters), "
           f"target {s['target_batch_size']} samples per step, {cfg.optimizer.name}, gradient codec {cfg.codec}.")}
Generated {escape(_when(s['at']))}.</p>
{now}
{f'<p id="damaged">{escape(damaged_line(s))}</p>' if s["damaged"] else ""}
<h2>Training</h2>
{figs}
<h2>Contributors</h2>
{leaders}
<h2>Rounds</h2>
{rounds}
<h2>Evaluations</h2>
{eval_section}
</body></html>
"""


def markdown(s: dict, report_url: str) -> str:
    """The pretrain flow's summary artifact: the loss figure inline, the last rounds, where the page is.
    Only numbers from the ledger go in, so nothing a peer wrote can shape the markdown."""
    loss = base64.b64encode(plots.figure("loss", s["history"])).decode()
    rows = "".join(f"| {h['round']} | {h['loss']:.4f} | {h['samples']} | {h['peers']} | {duration(h['duration_s'])} "
                   f"| {_num(h['samples_per_s'], '.1f')} |\n" for h in s["history"][-10:])
    return (f"Run {s['run']}: state {s['round']} committed, {len(s['peers'])} contributors.\n\n"
            f"![loss per round](data:image/png;base64,{loss})\n\n"
            "| round | loss | samples | contributors | duration | samples/s |\n|---|---|---|---|---|---|\n"
            f"{rows}\nThe whole report (figures, leaderboard, every round, evaluations): `{report_url}`\n")


def publish(run: Run, page: str) -> str:
    """Put the page at its key in the bucket; returns the key."""
    run.bucket.write_bytes(run.keys.report(), page.encode("utf-8"))
    return run.keys.report()
