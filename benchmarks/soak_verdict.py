"""The soak's verdict (benchmarks/soak.py, docs/soak.md): the ledger checked after the run, the
samples summarized into bounded-or-not verdicts, and the results as a table and a plot; for the
soak with faults (benchmarks/soak_faults.py), the one-process replay of every committed round and
its verdict."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

# What "bounded" means in the verdict (docs/soak.md): fds and threads may move by at most this
# much after warm-up; the working set may reach at most this multiple of its first-half maximum.
FD_SLACK, THREAD_SLACK, BUCKET_RATIO = 2, 1, 1.5
# What a COMMIT copies of each accepted shard, compared with its CLOSE's entry.
COMMITTED = ("key", "peer", "samples", "manifest_sha", "weight")


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


class Replay:
    """Every committed state recomputed in one process: from state 0, each round's mean of its
    CLOSE's accepted shards (read back and decoded by the run's codec, weighted as CLOSE says),
    the run's optimizer on the whole vector and its delta codec with its error feedback; no
    parts, aggregators, retries or restarts. Compared with the committed parameters bit for bit
    (invariant 4: repeated, restarted steps give the same bytes). ``next()`` after each commit,
    while the round's shards are still there (pruning takes them ``keep_states`` later)."""

    def __init__(self, run):
        from dedloc_pipeline.storage import vector

        cfg, fmt = run.config, run.dense_format
        if cfg.aggregation != "mean" or cfg.aggregator_optimizer.name == "lamb" or cfg.algorithm != "dedloc":
            raise ValueError("the replay takes the plain mean and an elementwise optimizer (AdamW, SGD)")
        self.run, self.state, self.differing, self.max_abs_diff = run, 0, [], 0.0
        self.params = run.load_params(0)
        self.slots = {n: vector.read_vector(run.bucket, run.keys.optim(0, n), fmt).copy()
                      for n in (*cfg.aggregator_optimizer.slots, "residual")}

    def next(self) -> None:
        """Replay round ``state`` and compare with state ``state + 1``."""
        import numpy as np

        from dedloc_pipeline.compute import optim
        from dedloc_pipeline.protocol.close import round_close
        from dedloc_pipeline.storage import codec, vector
        from dedloc_pipeline.storage.layout import volunteer_of

        run, r = self.run, self.state
        cfg, fmt = run.config, run.grad_format
        accepted = round_close(run, r).accepted
        total = np.zeros(run.flat.n, np.float64)
        weights: dict[str, float] = {}
        for s in accepted:
            arrays = vector.read_vector(run.bucket, run.keys.frozen(s.key), fmt, checksums=s.checksums, raw=True)
            codec.accumulate(total, arrays, fmt.codec, fmt.block, s.weight)
            weights[volunteer_of(s.peer)] = weights.get(volunteer_of(s.peer), 0.0) + s.weight
        grad = (total / np.array([weights[v] for v in sorted(weights)]).sum()).astype(np.float32)
        stepped = self.params.copy()
        slots = {n: v for n, v in self.slots.items() if n != "residual"}
        optim.apply(cfg.aggregator_optimizer, run.flat, 0, stepped, slots, grad, step=r + 1)
        _, params, residual = codec.delta_encode(self.params, stepped, cfg.param_codec, cfg.block_size,
                                                 self.slots["residual"])
        if residual is not None:
            self.slots["residual"] = residual
        got = run.load_params(r + 1)
        if not np.array_equal(got.view(np.uint32), params.view(np.uint32)):
            self.differing.append(r + 1)
            self.max_abs_diff = max(self.max_abs_diff, float(np.abs(got - params).max()))
        self.params, self.state = params, r + 1


def faults_verdict(run, replay: Replay, facts: dict) -> dict:
    """The soak with faults judged: its facts (benchmarks/soak_faults.py), the ledger read back,
    the replay; ``verdict`` holds one boolean a check, ``ok`` whether all passed."""
    import inspect

    from dedloc_pipeline.organizer import ledger

    b, k, rounds = run.bucket, run.keys, facts["reached"]
    checks = verify(run, rounds, run.config)
    unlisted, counted_end = [], {}
    for r in range(rounds):
        close, commit = b.read_json(k.close(r)), b.read_json(k.commit(r + 1))
        if close is None or commit is None:
            continue  # missing: verify's
        if [[s.get(f) for f in COMMITTED] for s in commit["shards"]] != \
                [[s.get(f) for f in COMMITTED] for s in close["accepted"]]:
            unlisted.append(r)
        for s in close["accepted"]:
            stream = s["data"]["stream"]
            counted_end[stream] = max([counted_end.get(stream, 0)] + [a + n for a, n in s["data"]["ranges"]])
    ends = run.stream_ends(rounds)
    uncovered = {p: [e, ends.get(p, 0)] for p, e in counted_end.items() if e > ends.get(p, 0)}
    open_s, wait_s = facts["open_s"], facts["wait_s"]
    worst = max(open_s, key=open_s.get, default=None)
    # a commit prunes the states its predecessors left (a kill mid-prune) up to ledger.prune's
    # window back, so only states older than that are left for good
    window = inspect.signature(ledger.prune).parameters["window"].default
    left = [s for s in checks["states_with_params"] if s not in checks["states_with_params_expected"]
            and s < rounds - run.config.keep_states - window]
    events = facts["events"]
    by = Counter(e["event"] for e in events)
    phases = {kind: dict(Counter(e.get("phase", "?") for e in events if e["event"] == kind))
              for kind in ("scheduler_killed", "scheduler_failed", "aggregator_killed", "aggregator_failed",
                           "worker_failed", "vanish", "leave_failed")}
    verdict = {
        "every_round_reached": facts["stalled"] is None and rounds == facts["rounds"],
        "all_commits": not checks["missing_commits"],
        "all_closes": not checks["missing_closes"],
        "commits_count_their_closes": not checks["samples_mismatched"],
        "commits_list_their_closes": not unlisted,  # every counted sample is in a COMMIT
        "no_sample_counted_twice": not checks["samples_counted_twice"],
        "streams_cover_counted": not uncovered,  # a returning peer continues after them
        "no_shard_rejected": not checks["rejected_shards"],  # every peer here is honest
        "replay_equals_every_state": replay.state == rounds and not replay.differing,
        "no_stall": worst is None or open_s[worst] <= facts["stall_bound_s"],
        "no_unexpected_failure": not facts["unexpected"],
        "pruned_to_checkpoints": not left and set(checks["states_with_params_expected"]) <= set(
            checks["states_with_params"]),
    }
    return {**{k: v for k, v in facts.items() if k != "events"},
            "events_by_kind": dict(by), "phases": phases, "checks": checks, "commits_unlisting": unlisted,
            "streams_uncovered": uncovered, "states_left_unpruned": left,
            "replay": {"states": replay.state, "bitwise": not replay.differing, "differing": replay.differing,
                       "max_abs_diff": replay.max_abs_diff},
            "stall": {"max_open_s": open_s[worst] if worst is not None else 0.0, "round": worst,
                      "max_until_commit_s": max(wait_s.values(), default=0.0),
                      "bound_s": facts["stall_bound_s"]},
            "events": events, "verdict": verdict, "ok": all(verdict.values())}


def faults_table(res: dict):
    from rich.table import Table

    t = Table(title=f"soak with faults: {res['reached']} of {res['rounds']} rounds, {res['ticks']} ticks "
                    f"({res['fake_s']:.0f} fake s, {res['wall_s']:.0f} s wall), seed {res['seed']}",
              title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    by, st, rp = res["events_by_kind"], res["stall"], res["replay"]
    rows = [
        ("rounds: engine / flow", f"{res['modes'].get('engine', 0)} / {res['modes'].get('flow', 0)}"),
        ("volunteers: ids; joins, returns, restarts (systemd)",
         f"{res['peer_ids']}; {by.get('join', 0)}, {by.get('return', 0)}, {by.get('restart', 0)}"),
        ("fake seconds with 0, 1, 2, ... volunteers live",
         ", ".join(f"{res['live_s'].get(n, 0):.0f}" for n in range(1 + max(map(int, res["live_s"]), default=0)))),
        ("departures: leave, vanish; failed workers", f"{by.get('leave', 0)}, {by.get('vanish', 0)}; "
                                                     f"{by.get('worker_failed', 0)}"),
        ("scheduler: killed (by step); failed", f"{by.get('scheduler_killed', 0)} "
                                                f"({_counts(res['phases']['scheduler_killed'])}); "
                                                f"{by.get('scheduler_failed', 0)}"),
        ("aggregators: killed (by step); failed", f"{by.get('aggregator_killed', 0)} "
                                                  f"({_counts(res['phases']['aggregator_killed'])}); "
                                                  f"{by.get('aggregator_failed', 0)}"),
        ("stretches: flaky, disk full", f"{res['stretches'].get('flaky', 0)}, {res['stretches'].get('full', 0)}"),
        ("requests; faults injected", f"{res['requests']}; {_counts(res['faults_injected'])}"),
        ("longest open with someone live (bound); until commit",
         f"{st['max_open_s']:.0f} s, round {st['round']} ({st['bound_s']:.0f} s); {st['max_until_commit_s']:.0f} s"),
        ("replay", f"{rp['states']} states, " + ("bit for bit" if rp["bitwise"] else
                                                 f"{len(rp['differing'])} differ, max |diff| "
                                                 f"{rp['max_abs_diff']:.3g}")),
    ]
    rows += [(f"check: {k.replace('_', ' ')}", "ok" if v else "FAILED") for k, v in res["verdict"].items()]
    for row in rows:
        t.add_row(*row)
    return t


def _counts(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"
