"""The soak's verdict (benchmarks/soak.py, docs/soak.md): the ledger checked after the run, the
samples summarized into bounded-or-not verdicts, and the results as a table and a plot."""

from __future__ import annotations

from pathlib import Path

# What "bounded" means in the verdict (docs/soak.md): fds and threads may move by at most this
# much after warm-up; the working set may reach at most this multiple of its first-half maximum.
FD_SLACK, THREAD_SLACK, BUCKET_RATIO = 2, 1, 1.5


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def verify(run, rounds: int, cfg) -> dict:
    """The ledger after the run: nothing lost, nothing counted twice."""
    b, k = run.bucket, run.keys
    missing_commits = [s for s in range(rounds + 1) if not b.exists(k.commit(s))]
    missing_closes, mismatched, streams, rejected = [], [], {}, []
    for r in range(rounds):
        close = b.read_json(k.close(r))
        if close is None:
            missing_closes.append(r)
            continue
        commit = b.read_json(k.commit(r + 1)) or {}
        if commit.get("samples") != close["samples"] or close["samples"] < close["target"]:
            mismatched.append(r)
        rejected += [dict(s, round=r) for s in close["rejected"]]
        for s in close["accepted"]:
            idx = streams.setdefault(s["data"]["stream"], [])
            idx += [i for a, n in s["data"]["ranges"] for i in range(a, a + n)]
    twice = {p: len(ix) - len(set(ix)) for p, ix in streams.items() if len(ix) != len(set(ix))}
    latest = run.latest()
    kept = [s for s in range(latest + 1) if b.find(k.params(s))]
    expect = sorted({s for s in range(latest + 1)
                     if s % cfg.checkpoint_every == 0 or s > latest - cfg.keep_states})
    return {"missing_commits": missing_commits, "missing_closes": missing_closes,
            "samples_mismatched": mismatched, "samples_counted_twice": twice, "rejected_shards": rejected,
            "streams": len(streams), "stream_samples": sum(len(v) for v in streams.values()),
            "states_with_params": kept, "states_with_params_expected": expect}


def summarize(samples: list[dict], round_s: list[float], wall: float, rounds: int, checks: dict,
              events: list[dict], cfg) -> dict:
    half = rounds // 2
    settle = min(10, max(1, rounds // 4))  # fds and threads: constant from here on
    first = [s for s in samples if s["state"] <= half]
    second = [s for s in samples if s["state"] >= half]
    steady = [s for s in samples if s["state"] >= settle]
    warm = [s for s in first if s["state"] >= settle] or first
    slope = _slope([s["state"] for s in second], [s["rss_mb"] for s in second]) * 100
    losses = [s["loss"] for s in samples if s["loss"] is not None]

    def span(key, rows):
        vals = [s[key] for s in rows]
        return {"min": min(vals), "max": max(vals)}

    fds, threads = span("fds", steady), span("threads", steady)
    work1, work2 = max(s["working_bytes"] for s in first), max(s["working_bytes"] for s in second)
    after = round_s[settle:] or round_s
    resumed = [e for e in events if e["event"] in ("restart", "return")]
    verdict = {
        "all_commits": not checks["missing_commits"],
        "all_closes": not checks["missing_closes"],
        "commits_count_their_closes": not checks["samples_mismatched"],
        "no_shard_rejected": not checks["rejected_shards"],  # every peer here is honest
        "no_sample_counted_twice": not checks["samples_counted_twice"],
        # a restart continues after what the Worker it replaces uploaded; a return (after rounds
        # away) after everything the peer id ever uploaded
        "restarted_streams_continue": all(e["resumes_at"] >= e["incarnation_end"] for e in resumed
                                          if e["event"] == "restart"),
        "returned_streams_continue": all(e["resumes_at"] >= e["ledger_end"] for e in resumed
                                         if e["event"] == "return"),
        "pruned_to_checkpoints": checks["states_with_params"] == checks["states_with_params_expected"],
        "loss_fell": bool(losses) and losses[-1] < losses[0],
        "fds_constant": fds["max"] - fds["min"] <= FD_SLACK,
        "threads_constant": threads["max"] - threads["min"] <= THREAD_SLACK,
        "transfer_threads_bounded": all(x["transfer_threads"] <= x["peers"] for x in samples),
        # judged over two churn cycles or more: before that the kept states are still filling up
        "working_set_bounded": work2 <= BUCKET_RATIO * work1 if rounds >= 20 else None,
    }
    return {
        "rounds": rounds, "wall_s": round(wall, 1), "s_per_round": round(wall / rounds, 3),
        "s_per_round_after_warmup": round(sum(after) / len(after), 3), "max_round_s": round(max(round_s), 2),
        "warmup_state": settle, "second_half_from": half,
        "rss_mb": {"start": samples[0]["rss_mb"], "after_warmup": next(s["rss_mb"] for s in samples
                                                                        if s["state"] >= settle),
                   "at_half": second[0]["rss_mb"], "end": samples[-1]["rss_mb"],
                   "max": max(s["rss_mb"] for s in samples),
                   "second_half": span("rss_mb", second),
                   "slope_mb_per_100_rounds": round(slope, 2),
                   # a leak of x MB a round shows here as about x * rounds / 2
                   "growth_second_half_mb": round(max(s["rss_mb"] for s in second)
                                                  - max(s["rss_mb"] for s in warm), 1)},
        "rss_trimmed_mb": None if "rss_trimmed_mb" not in samples[0] else {
            "after_warmup": warm[0]["rss_trimmed_mb"], "at_half": second[0]["rss_trimmed_mb"],
            "end": samples[-1]["rss_trimmed_mb"], "second_half": span("rss_trimmed_mb", second),
            "slope_mb_per_100_rounds": round(_slope([s["state"] for s in second],
                                                    [s["rss_trimmed_mb"] for s in second]) * 100, 2)},
        "py_objects": {"after_warmup": warm[0]["py_objects"], "at_half": second[0]["py_objects"],
                       "end": samples[-1]["py_objects"],
                       "slope_per_100_rounds": round(_slope([s["state"] for s in second],
                                                            [s["py_objects"] for s in second]) * 100)},
        "fds": {**fds, "start": samples[0]["fds"]}, "threads": {**threads, "start": samples[0]["threads"]},
        "bucket": {"end": {k: samples[-1][k] for k in samples[-1] if "bytes" in k or "files" in k},
                   "working_bytes_max_first_half": work1, "working_bytes_max_second_half": work2,
                   "bytes_max": max(s["bytes"] for s in samples), "files_max": max(s["files"] for s in samples),
                   "ledger_bytes_per_round": round(samples[-1]["ledger_bytes"] / rounds)},
        "loss": {"first": losses[0] if losses else None, "last": losses[-1] if losses else None,
                 "first_10_mean": sum(losses[:10]) / len(losses[:10]) if losses else None,
                 "last_10_mean": sum(losses[-10:]) / len(losses[-10:]) if losses else None},
        "events": events, "checks": checks, "verdict": verdict, "ok": all(v is not False for v in verdict.values()),
        "samples": samples,
    }


def table(res: dict):
    from rich.table import Table

    r, b, loss = res["rss_mb"], res["bucket"], res["loss"]
    MiB = 2 ** 20
    t = Table(title=f"soak: {res['rounds']} rounds, tiny (sequence 32), int8, delayed updates, churn every "
                    f"{res['settings']['every']} rounds", title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [
        ("wall time", f"{res['wall_s']:.0f} s"),
        ("s/round (after warm-up; slowest)", f"{res['s_per_round']:.2f} ({res['s_per_round_after_warmup']:.2f}; "
                                             f"{res['max_round_s']:.2f})"),
        ("RSS start / after warm-up / half / end", f"{r['start']:.0f} / {r['after_warmup']:.0f} / "
                                                   f"{r['at_half']:.0f} / {r['end']:.0f} MB"),
        ("RSS second half min–max", f"{r['second_half']['min']:.0f}–{r['second_half']['max']:.0f} MB"),
        ("RSS slope, second half", f"{r['slope_mb_per_100_rounds']:+.1f} MB / 100 rounds"),
        ("RSS growth: second-half max − first-half max after warm-up", f"{r['growth_second_half_mb']:+.0f} MB"),
        ("Python objects after warm-up / half / end (slope)",
         f"{res['py_objects']['after_warmup']} / {res['py_objects']['at_half']} / {res['py_objects']['end']} "
         f"({res['py_objects']['slope_per_100_rounds']:+d} / 100 rounds)"),
        *([] if not (tr := res.get("rss_trimmed_mb")) else [(
            "RSS after malloc_trim: warm-up / half / end (slope)",
            f"{tr['after_warmup']:.0f} / {tr['at_half']:.0f} / {tr['end']:.0f} MB "
            f"({tr['slope_mb_per_100_rounds']:+.1f} / 100 rounds)")]),
        ("open fds after warm-up (start)", f"{res['fds']['min']}–{res['fds']['max']} ({res['fds']['start']})"),
        ("threads after warm-up (start)", f"{res['threads']['min']}–{res['threads']['max']} "
                                          f"({res['threads']['start']})"),
        ("bucket at the end", f"{b['end']['bytes'] / MiB:.1f} MiB, {b['end']['files']} files"),
        ("  ledger / checkpoints / working set", f"{b['end']['ledger_bytes'] / MiB:.2f} / "
                                                 f"{b['end']['checkpoint_bytes'] / MiB:.1f} / "
                                                 f"{b['end']['working_bytes'] / MiB:.1f} MiB"),
        ("working set max, first / second half", f"{b['working_bytes_max_first_half'] / MiB:.1f} / "
                                                 f"{b['working_bytes_max_second_half'] / MiB:.1f} MiB"),
        ("loss first → last (means of 10)", f"{loss['first']:.3f} → {loss['last']:.3f} "
                                            f"({loss['first_10_mean']:.3f} → {loss['last_10_mean']:.3f})"),
        ("churn events", ", ".join(f"{k} {sum(e['event'] == k for e in res['events'])}"
                                   for k in ("leave", "join", "restart", "return"))),
    ]
    rows += [(f"check: {k.replace('_', ' ')}", {True: "ok", False: "FAILED", None: "not judged"}[v])
             for k, v in res["verdict"].items()]
    for row in rows:
        t.add_row(*row)
    return t


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    s = res["samples"]
    x = [p["state"] for p in s]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    series = [("RSS (MB)", [p["rss_mb"] for p in s]), ("open fds", [p["fds"] for p in s]),
              ("bucket (MiB)", [p["bytes"] / 2**20 for p in s]), ("committed loss", [p["loss"] for p in s])]
    for ax, (label, y) in zip(axes, series):
        ax.plot(x, y)
        ax.set_ylabel(label)
    axes[2].plot(x, [p["working_bytes"] / 2**20 for p in s], label="working set")
    axes[2].legend()
    axes[-1].set_xlabel("state (rounds committed)")
    fig.tight_layout()
    fig.savefig(path)
    return True
