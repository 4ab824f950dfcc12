"""What every flow shares: opening a run once per process, and choosing the task runner."""

from __future__ import annotations

import contextlib
import functools
import re

from prefect.task_runners import ThreadPoolTaskRunner

from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket


@functools.lru_cache(maxsize=8)
def open_run(bucket: str, run: str) -> Run:
    return Run(Bucket(bucket), run)


@functools.lru_cache(maxsize=8)
def scheduler(bucket: str, run: str, poll_s: float | None = None, volunteers: bool = False) -> Scheduler:
    """One per process, so shard validations are cached across the polls of a round.
    ``volunteers``: its CLOSEs give the parts to volunteer aggregators (docs/aggregators.md)."""
    return Scheduler(open_run(bucket, run), poll_s=poll_s, volunteers=volunteers)


@contextlib.contextmanager
def dask_address(kind: str, parallel: int, address: str | None):
    """The Dask scheduler to aggregate on: the given one, or a local cluster for the whole flow
    run (a fresh cluster per round would spend seconds starting worker processes each time), its
    workers without Dask's profiler, which can freeze the whole process on CPython 3.11."""
    if kind != "dask" or address:
        yield address
        return
    import dask
    from distributed import LocalCluster
    # The profiler calls sys._current_frames() every 10 ms. On CPython 3.11 that holds the
    # interpreter's thread-list lock while it allocates frame objects; an allocation can run the
    # garbage collector, and a collected threading.local takes the same lock in its dealloc: the
    # thread deadlocks on itself holding the GIL, every thread stops (cpython#106883,
    # dask/distributed#8616; the Dask case's hangs in issue 13). A cluster of your own on 3.11
    # wants DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False on its workers for the same reason.
    # In-process workers: no process start-up per worker; numpy and zarr release the GIL. The
    # setting holds while the cluster lives, so any worker it (re)starts is built without it.
    with dask.config.set({"distributed.worker.profile.enabled": False}), \
            LocalCluster(n_workers=parallel, threads_per_worker=1, processes=False,
                         dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def task_runner(kind: str, parallel: int, address: str | None = None):
    """``threads`` (default), ``processes``, ``dask`` (the ``scale`` extra) at ``address``, or
    ``task-workers``: the round flow's own steps on threads, its reduce and apply tasks on Prefect
    task workers anywhere (flows/aggregators.py); ``volunteers``: the parts to volunteer
    aggregators, what they do not settle on threads here (docs/aggregators.md)."""
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=parallel)
    if kind in ("task-workers", "volunteers"):
        return ThreadPoolTaskRunner(max_workers=parallel)
    if kind == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner
        return ProcessPoolTaskRunner(max_workers=parallel)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner
        return DaskTaskRunner(address=address)
    raise ValueError(f"unknown task runner {kind!r}: threads, processes, dask, task-workers or volunteers")


def artifact_key(run: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run}-{what}".lower())
