"""`make bench`: every benchmark in one run, side by side, as tables and one JSON file.

Ratios are taken between numbers measured in this same run on this same machine: ours against
the machine's limit and against hivemind (benchmark 1), the aggregator against a numpy lower bound
(benchmark 3). See docs/benchmarks.md for what each one measures.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()
BENCHMARKS = ("throughput", "wire", "aggregation", "compute", "scale", "coordination", "shaped", "local_steps")


def _table(title: str, columns: list[str], rows: list[list]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        t.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r])
    return t


# Each runner imports its benchmark: the scale benchmark's spawned writers re-import this module
# and must stay light (no torch).

def throughput(out: dict) -> Table:
    from . import collab, hivemind_peers

    ours = collab.collaborate(delayed=True)
    out["throughput"] = res = {"ours": ours, "limit": collab.limit(),
                               "limit_per_peer": collab.limit(processes=ours["peers"])}
    try:
        res["hivemind"] = hivemind_peers.run()
    except ImportError as exc:
        res["hivemind"] = {"skipped": str(exc)}
    lim = res["limit"]["samples_per_s"]
    res["ours_over_limit"] = ours["samples_per_s"] / lim
    hm = res["hivemind"].get("samples_per_s")
    res["ours_over_hivemind"] = ours["samples_per_s"] / hm if hm else None
    rows = [[name, r.get("samples_per_s", "-"), r.get("s_per_round", "-"), r.get("compute_fraction", "-"),
             r["samples_per_s"] / lim if "samples_per_s" in r else "-"]
            for name, r in (("dedloc-pipeline", ours), ("hivemind 1.1.12", res["hivemind"]),
                            ("limit: no collaboration, a process per core", res["limit"]),
                            ("no collaboration, a process per peer", res["limit_per_peer"]))]
    return _table("1. throughput: tiny, 4 peers, micro-batch 8, target 256, int8",
                  ["system", "samples/s", "s/round", "compute fraction", "of limit"], rows)


def compute(out: dict) -> Table:
    from . import collab

    on = out.get("throughput", {}).get("ours") or collab.collaborate(delayed=True)
    off = collab.collaborate(delayed=False)
    out["compute"] = {"delayed": on, "not_delayed": off}
    rows = [[f"delayed updates {label}", r["compute_fraction"], r["samples_per_s"], r["stale_fraction"]]
            for label, r in (("on", on), ("off", off))]
    return _table("4. worker compute fraction (same collaboration as 1)",
                  ["worker", "compute fraction", "samples/s", "stale share"], rows)


def wire_(out: dict) -> Table:
    from . import wire

    out["wire"] = res = wire.run()
    rows = [[c["codec"], c["download_codec"], c["up_bytes_per_param"], c["down_bytes_per_param"],
             c["total_bytes_per_param"], c["loss_max_rel_dev"]] for c in res["cases"]]
    return _table("2. bytes per parameter per peer per round (counted by the bucket)",
                  ["shards", "deltas", "up", "down", "total", "loss vs none (max rel.)"], rows)


def aggregation_(out: dict) -> Table:
    from . import aggregation

    out["aggregation"] = res = aggregation.run()
    return _table("3. aggregation: 16 int8 shards of 10M parameters, file://", ["step", "seconds", "× lower bound"],
                  [[k, v["seconds"], v.get("ratio", "-")] for k, v in res["timings"].items()])


def scale_(out: dict) -> Table:
    from . import scale

    out["scale"] = res = scale.run()
    rows = [[c["peers"], c["n_params"], c["validate_s"], c["finish_s"], c["requests"]] for c in res["cases"]]
    return _table("5. scale: simulated peers per round (1M parameters)",
                  ["peers", "params", "validate s", "reduce+apply s", "requests"], rows)


def coordination_(out: dict) -> Table:
    """Simulated volunteers against moto's S3 server: requests per volunteer, close latency, dollars."""
    from . import coordination

    out["coordination"] = res = coordination.run()
    return coordination.table(res)


def shaped_(out: dict) -> Table:
    """Volunteers and hivemind peers behind tc-shaped household links (root only; else skipped)."""
    from . import shaped

    out["shaped"] = res = shaped.run()
    return shaped.table(res)


def local_steps_(out: dict) -> Table:
    """The causal decoder on Bengali: default vs diloco vs diloco with sparse updates, equal samples."""
    from . import local_steps

    out["local_steps"] = res = local_steps.run()
    return local_steps.table(res)


def gpu(out: dict) -> Table:
    """Not in the default set: one `sahajbert` worker on the GPU, a CPU scheduler beside it."""
    from . import collab

    out["gpu"] = r = collab.collaborate(peers=1, preset="sahajbert", micro_batch=8, target=128, warmup=1,
                                        rounds=3, worker_args=("--device", "cuda"), timeout_s=540)
    return _table("sahajbert worker on the GPU (ALBERT-large, sequence 512, micro-batch 8, target 128)",
                  ["samples/s", "s/round", "compute fraction"],
                  [[r["samples_per_s"], r["s_per_round"], r["compute_fraction"]]])


def soak_(out: dict) -> Table:
    """Not in the default set: 300 rounds with churn; memory, fds and the bucket stay bounded (docs/soak.md)."""
    from . import soak

    out["soak"] = r = soak.soak()
    return soak.table(r)


RUNNERS = {"throughput": throughput, "wire": wire_, "aggregation": aggregation_, "compute": compute,
           "scale": scale_, "coordination": coordination_, "shaped": shaped_, "local_steps": local_steps_,
           "gpu": gpu, "soak": soak_}


def main(only: Optional[list[str]] = typer.Argument(None, help=f"some of: {', '.join(BENCHMARKS)}; or gpu, soak"),
         out_dir: Path = typer.Option(Path(".dedloc/bench"), help="where results.json goes")):
    """Run the benchmarks and write OUT_DIR/results.json."""
    names = only or list(BENCHMARKS)
    out: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": platform.python_version()},
                 "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.monotonic()
        console.print(RUNNERS[name](out))
        out.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 1)
        (out_dir / "results.json").write_text(json.dumps(out, indent=1))
    console.print(f"results: {out_dir / 'results.json'} ({sum(out['seconds'].values()):.0f} s)")


if __name__ == "__main__":
    typer.run(main)
