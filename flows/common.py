"""What every flow shares: opening a run once per process, and choosing the task runner."""

from __future__ import annotations

import functools
import re

from prefect.task_runners import ThreadPoolTaskRunner

from dedloc_pipeline.run import Run
from dedloc_pipeline.scheduler import Scheduler
from dedloc_pipeline.storage import Bucket


@functools.lru_cache(maxsize=8)
def open_run(bucket: str, run: str) -> Run:
    return Run(Bucket(bucket), run)


@functools.lru_cache(maxsize=8)
def scheduler(bucket: str, run: str) -> Scheduler:
    """One per process, so shard validations are cached across the polls of a round."""
    return Scheduler(open_run(bucket, run))


def task_runner(kind: str, parallel: int, address: str | None = None):
    """``threads`` (default), ``processes``, or ``dask`` (the ``scale`` extra; ``address`` of a
    running Dask scheduler, or a local cluster when empty)."""
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=parallel)
    if kind == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner
        return ProcessPoolTaskRunner(max_workers=parallel)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner
        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": parallel, "threads_per_worker": 1})
    raise ValueError(f"unknown task runner {kind!r}: threads, processes or dask")


def artifact_key(run: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run}-{what}".lower())
