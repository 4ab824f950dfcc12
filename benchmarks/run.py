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
BENCHMARKS = ("throughput", "wire", "aggregation", "compute", "scale", "coordination", "shaped", "local_steps",
              "aggregators", "recovery", "corpus")


# Each runner imports its benchmark: the scale benchmark's spawned writers re-import this module
# and must stay light (no torch).

def throughput_(out: dict) -> Table:
    """Ours against the machine's limit and hivemind's peers."""
    from . import throughput

    out["throughput"] = res = throughput.run()
    return throughput.table(res)


def compute(out: dict) -> Table:
    """The worker's compute fraction, delayed updates on (benchmark 1's collaboration, if it ran) and off."""
    from . import throughput

    out["compute"] = res = throughput.compute(out.get("throughput", {}).get("ours"))
    return throughput.compute_table(res)


def wire_(out: dict) -> Table:
    """Bytes per parameter per peer per round, and what each codec costs in loss."""
    from . import wire

    out["wire"] = res = wire.run()
    return wire.table(res)


def aggregation_(out: dict) -> Table:
    """One round's reduction against a plain-numpy lower bound."""
    from . import aggregation

    out["aggregation"] = res = aggregation.run()
    return aggregation.table(res)


def scale_(out: dict) -> Table:
    """What a round costs the scheduler as the number of peers grows."""
    from . import scale

    out["scale"] = res = scale.run()
    return scale.table(res)


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


def aggregators_(out: dict) -> Table:
    """The organizer's bytes and requests a round with volunteer aggregators, against without."""
    from . import aggregators

    out["aggregators"] = res = aggregators.run()
    return aggregators.table(res)


def recovery_(out: dict) -> Table:
    """The scheduler stopped and started again on a loaded machine: how late workers hold each state."""
    from . import recovery

    out["recovery"] = res = recovery.run()
    return recovery.table(res)


def corpus_(out: dict) -> Table:
    """A data set made from gigabytes of text (`make big-corpus`): MB/s per core, two cores against one, memory."""
    from . import corpus

    out["corpus"] = res = corpus.run(float(os.environ.get("CORPUS_GB", "2")))
    return corpus.table(res)


def gpu(out: dict) -> Table:
    """Not in the default set: one `sahajbert` worker on the GPU, a CPU scheduler beside it."""
    from . import throughput

    out["gpu"] = r = throughput.gpu()
    return throughput.gpu_table(r)


def soak_(out: dict) -> Table:
    """Not in the default set: 300 rounds with churn; memory, fds and the bucket stay bounded (docs/soak.md)."""
    from . import soak, soak_verdict

    out["soak"] = r = soak.soak()
    return soak_verdict.table(r)


RUNNERS = {"throughput": throughput_, "wire": wire_, "aggregation": aggregation_, "compute": compute,
           "scale": scale_, "coordination": coordination_, "shaped": shaped_, "local_steps": local_steps_,
           "aggregators": aggregators_, "recovery": recovery_, "corpus": corpus_, "gpu": gpu, "soak": soak_}


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
