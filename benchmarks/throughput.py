"""Benchmarks 1 and 4, and the GPU worker: the collaboration of benchmarks/collab.py against the
machine's limit and against hivemind's peers (1), with delayed updates on and off (4), and one
``sahajbert`` worker on a GPU (not in the default set)."""

from __future__ import annotations

from . import collab, tables


def run() -> dict:
    """Benchmark 1: ours, the limit (a process per core, and a process per peer) and hivemind, with
    the ratios between them."""
    from . import hivemind_peers

    ours = collab.collaborate(delayed=True)
    res = {"ours": ours, "limit": collab.limit(), "limit_per_peer": collab.limit(processes=ours["peers"])}
    try:
        res["hivemind"] = hivemind_peers.run()
    except ImportError as exc:
        res["hivemind"] = {"skipped": str(exc)}
    lim = res["limit"]["samples_per_s"]
    res["ours_over_limit"] = ours["samples_per_s"] / lim
    hm = res["hivemind"].get("samples_per_s")
    res["ours_over_hivemind"] = ours["samples_per_s"] / hm if hm else None
    return res


def table(res: dict):
    lim = res["limit"]["samples_per_s"]
    rows = [[name, r.get("samples_per_s", "-"), r.get("s_per_round", "-"), r.get("compute_fraction", "-"),
             r["samples_per_s"] / lim if "samples_per_s" in r else "-"]
            for name, r in (("dedloc-pipeline", res["ours"]), ("hivemind 1.1.12", res["hivemind"]),
                            ("limit: no collaboration, a process per core", res["limit"]),
                            ("no collaboration, a process per peer", res["limit_per_peer"]))]
    return tables.table("1. throughput: tiny, 4 peers, micro-batch 8, target 256, int8",
                  ["system", "samples/s", "s/round", "compute fraction", "of limit"], rows)


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
