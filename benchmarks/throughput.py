"""Benchmarks 1 and 4, and the GPU worker: the collaboration of benchmarks/collab.py against the
machine's limit and against hivemind's peers (1), with delayed updates on and off (4), and one
``sahajbert`` worker on a GPU (not in the default set)."""

from __future__ import annotations

from rich.console import Group

from . import collab, latency, tables


def run(rounds: int = 8) -> dict:
    """Benchmark 1: ours, the limit (a process per core, and a process per peer) and hivemind, with
    the ratios between them. The machine's speed drifts by several percent over minutes, so each
    limit is measured just before and just after ours and their mean is the one it is held to."""
    from . import hivemind_peers

    peers = 4
    before = {"limit": collab.limit(), "limit_per_peer": collab.limit(processes=peers)}
    ours = collab.collaborate(peers=peers, delayed=True, rounds=rounds)
    after = {"limit_per_peer": collab.limit(processes=peers), "limit": collab.limit()}
    res = {"ours": ours, **{k: _mean_of(before[k], after[k]) for k in before}}
    try:
        res["hivemind"] = hivemind_peers.run()
    except ImportError as exc:
        res["hivemind"] = {"skipped": str(exc)}
    res["ours_over_limit"] = ours["samples_per_s"] / res["limit"]["samples_per_s"]
    # the round's own overhead: against the same 4 processes training with no collaboration,
    # so the cost of time-sharing 4 peers on this machine's cores is not counted as the round's
    res["ours_over_limit_per_peer"] = ours["samples_per_s"] / res["limit_per_peer"]["samples_per_s"]
    hm, hm_target = res["hivemind"].get("samples_per_s"), res["hivemind"].get("samples_per_s_target")
    res["ours_over_hivemind"] = ours["samples_per_s"] / hm if hm else None
    # one target batch a round, as hivemind reports itself: the rounds' overshoot not counted
    res["ours_over_hivemind_target"] = ours["samples_per_s_target"] / hm_target if hm_target else None
    return res


def _mean_of(before: dict, after: dict) -> dict:
    return {**after, "samples_per_s": (before["samples_per_s"] + after["samples_per_s"]) / 2,
            "before_after": [before["samples_per_s"], after["samples_per_s"]]}


def table(res: dict):
    lim, per_peer = res["limit"]["samples_per_s"], res["limit_per_peer"]["samples_per_s"]
    rows = [[name, r.get("samples_per_s", "-"), r.get("s_per_round", "-"), r.get("compute_fraction", "-"),
             r["samples_per_s"] / lim if "samples_per_s" in r else "-",
             r["samples_per_s"] / per_peer if "samples_per_s" in r else "-"]
            for name, r in (("dedloc-pipeline", res["ours"]), ("hivemind 1.1.12", res["hivemind"]),
                            ("limit: no collaboration, a process per core", res["limit"]),
                            ("no collaboration, a process per peer", res["limit_per_peer"]))]
    ours, theirs = res["ours"], res["hivemind"]
    rows[0] += [ours["samples_per_s_target"], ours["samples_per_s_target"] / per_peer, ours["counted_fraction"]]
    rows[1] += [theirs.get("samples_per_s_target", "-"), "-", "-"]
    for row in rows[2:]:
        row += ["-", "-", "-"]
    return Group(tables.table("1. throughput: tiny, 4 peers, micro-batch 8, target 256, int8 "
                              "(limits: mean of before and after)",
                              ["system", "samples/s", "s/round", "compute fraction", "of limit",
                               "of a process per peer", "target batch's samples/s", "of a process per peer",
                               "computed samples counted"], rows),
                 latency.table("1. the round's latency budget, seconds (benchmarks/latency.py)",
                               {"loopback": ours["latency"]}))


def compute(delayed: dict | None = None) -> dict:
    """Benchmark 4: the worker's compute fraction with delayed updates (benchmark 1's collaboration
    when given) and without."""
    return {"delayed": delayed or collab.collaborate(delayed=True), "not_delayed": collab.collaborate(delayed=False)}


def compute_table(res: dict):
    rows = [[f"delayed updates {label}", r["compute_fraction"], r["samples_per_s"], r["stale_fraction"]]
            for label, r in (("on", res["delayed"]), ("off", res["not_delayed"]))]
    return tables.table("4. worker compute fraction (same collaboration as 1)",
                  ["worker", "compute fraction", "samples/s", "stale share"], rows)


def gpu() -> dict:
    """One ``sahajbert`` worker on the GPU, a CPU scheduler beside it."""
    return collab.collaborate(peers=1, preset="sahajbert", micro_batch=8, target=128, warmup=1, rounds=3,
                              worker_args=("--device", "cuda"), timeout_s=540)


def gpu_table(r: dict):
    return tables.table("sahajbert worker on the GPU (ALBERT-large, sequence 512, micro-batch 8, target 128)",
                  ["samples/s", "s/round", "compute fraction"],
                  [[r["samples_per_s"], r["s_per_round"], r["compute_fraction"]]])
