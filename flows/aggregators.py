"""The round's aggregation tasks, ``reduce_part`` and ``apply_part`` (one part of the model each),
and aggregators on any machine: a Prefect task worker serving them, for
``pretrain(runner="task-workers")``.

What a volunteer with good bandwidth runs (``dedloc aggregator``). It needs:

* ``PREFECT_API_URL`` of the organizer's Prefect server (task workers cannot use the temporary
  per-process API), and the organizer's version of the project on the same Python minor version:
  a task run is matched to a task by its key, the name plus a hash of the function's code object
  (line numbers included), which the aggregator prints when it starts;
* credentials that can read the run and write its aggregation outputs (state ``r+1``'s
  parameters, delta and optimizer state, round ``r``'s ``reduced/`` scratch): an aggregator is
  trusted as much as the scheduler;
* the task storage: Prefect keeps every background task's parameters in result storage, written
  by the flow and read by the task worker. By default that is a folder under PREFECT_HOME, which
  only processes on the organizer's machine share. Elsewhere, point every side (the organizer's
  worker and each aggregator) at one block with
  ``PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK=remote-file-system/dedloc-tasks``, made once
  by ``save_task_storage("s3://collab/prefect-tasks")``.

The flow waits for the task runs' final states and never reads their results (the bucket holds
what they wrote), so only the parameters travel through that storage.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from prefect import task
from prefect.futures import PrefectDistributedFuture
from prefect.settings import get_current_settings

from dedloc_pipeline.compute import aggregation
from flows.common import open_run

STORAGE_SETTING = "PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK"
WAIT_S = 1800.0  # longest a round's reduce (or apply) phase may take on the task workers
NO_STATE_POLL_S = 0.5  # how often a task run without a state yet is asked again
DONE: Counter[str] = Counter()  # task runs this process finished, by task and outcome


@task(retries=3, retry_delay_seconds=2, tags=["dedloc-aggregator"])
def reduce_part(bucket: str, run: str, r: int, part: int) -> str:
    return aggregation.reduce_part(open_run(bucket, run), r, part)


@task(retries=3, retry_delay_seconds=2, tags=["dedloc-aggregator"])
def apply_part(bucket: str, run: str, r: int, part: int) -> str:
    return aggregation.apply_part(open_run(bucket, run), r, part)


def identity() -> str:
    """This aggregator as Prefect's task worker names its subscription: host and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _report(verb: str):
    def hook(task, task_run, state) -> None:
        from prefect.context import TaskRunContext
        ctx = TaskRunContext.get()
        p = ctx.parameters if ctx and ctx.parameters else {}
        what = f"{p.get('run')} round {p.get('r')} part {p.get('part')}" if p else task_run.name
        took = ""
        if task_run.start_time is not None:
            took = f" in {time.time() - task_run.start_time.timestamp():.1f}s"
        # Not print(): the flow's log_prints travels with the task run and would send it to the API only.
        DONE[f"{task.name} {verb}"] += 1
        sys.stdout.write(f"aggregator {identity()}: {task.name} {what} {verb}{took}\n")
        sys.stdout.flush()
    return hook


def tasks():
    """The served tasks: the round flow's own (same task keys), reporting each run they finish.
    With a shared task storage their results (marker keys, which nobody reads back) go there too:
    the worker reads a run's parameters from the task's result storage, and a task run otherwise
    persists into the submitting flow run's result store, a folder on the organizer's machine."""
    shared = get_current_settings().tasks.scheduling.default_storage_block
    extra = {"result_storage": shared} if shared else {}
    return [t.with_options(on_completion=[_report("done")], on_failure=[_report("FAILED")], **extra)
            for t in (reduce_part, apply_part)]


def serve(limit: int | None = 2, timeout_s: float | None = None) -> None:
    """Take reduce and apply task runs of every pretrain flow run under ``runner="task-workers"``
    until interrupted (Ctrl-C or SIGTERM) or ``timeout_s`` seconds pass. ``limit``: task runs at
    once (None: no limit); each reads one part of every accepted shard."""
    settings = get_current_settings()
    if not settings.api.url:
        raise RuntimeError("PREFECT_API_URL is not set: an aggregator takes its work from the organizer's "
                           "Prefect server (e.g. PREFECT_API_URL=http://organizer:4200/api)")
    storage = settings.tasks.scheduling.default_storage_block
    served = tasks()
    print(f"aggregator {identity()}: serving {' and '.join(t.task_key for t in served)} from {settings.api.url} "
          f"(limit {limit}; task storage {storage or 'local, under PREFECT_HOME: same machine only'})",
          flush=True)
    from prefect.task_worker import serve as serve_tasks
    try:
        serve_tasks(*served, limit=limit, timeout=timeout_s)
    except KeyboardInterrupt:  # Ctrl-C: a task run cut short is redone when the pretrain run restarts
        pass
    print(f"aggregator {identity()}: stopped; task runs done: {dict(DONE) or 'none'}", flush=True)


def run_parts(task, bucket: str, run: str, r: int, parts: Iterable[int],
              timeout_s: float = WAIT_S) -> list[PrefectDistributedFuture]:
    """The flow's side: one background task run per part for the task workers, all waited for.
    Returns the (completed) futures; raises if one failed or they did not finish in time."""
    futures = [task.delay(bucket, run, r, part) for part in parts]
    deadline = time.monotonic() + timeout_s
    for f in futures:
        wait_for(f, deadline)
    states = [f.state for f in futures]
    waiting = sorted({s.name for s in states if not s.is_final()})
    if waiting:
        raise TimeoutError(
            f"round {r}: {task.name} runs not finished after {timeout_s:.0f}s (states: {', '.join(waiting)}); "
            f"is an aggregator (`dedloc aggregator`, flows/aggregators.py) serving {task.task_key} from "
            f"this Prefect server (the same flows/ code: the key hashes it), with the same {STORAGE_SETTING}?")
    failed = [s for s in states if not s.is_completed()]
    if failed:
        raise RuntimeError(f"round {r}: {len(failed)} {task.name} runs ended {failed[0].name} on the task "
                           f"workers: {failed[0].message}")
    return futures


def wait_for(future: PrefectDistributedFuture, deadline: float, sleep=time.sleep, now=time.monotonic) -> None:
    """``future.wait`` until ``deadline`` (a ``now()`` reading). Prefect's wait raises RuntimeError
    while the task run ``delay`` created has no state yet: a busy server records its Scheduled state
    late (seen once in a loaded CI run). That is asked again; what is still unfinished at the
    deadline is for the caller to report."""
    while True:
        try:
            return future.wait(max(0.0, deadline - now()))
        except RuntimeError as exc:
            if "has no state" not in str(exc):
                raise
            if now() >= deadline:
                return
            sleep(NO_STATE_POLL_S)


def save_task_storage(url: str, name: str = "dedloc-tasks", **storage_options) -> str:
    """Make (or replace) the shared task storage block at ``url``: an fsspec URL such as
    ``s3://collab/prefect-tasks`` (``storage_options`` go to fsspec, e.g.
    ``client_kwargs={"endpoint_url": ...}``; leave credentials out and each process uses its own),
    or a folder every side mounts (a path or ``file://``). Returns the value for
    PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK."""
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem
    if "://" not in url or url.startswith("file://"):
        path = Path(url.removeprefix("file://")).resolve()
        LocalFileSystem(basepath=str(path)).save(name, overwrite=True)
        return f"local-file-system/{name}"
    RemoteFileSystem(basepath=url, settings=storage_options).save(name, overwrite=True)
    return f"remote-file-system/{name}"
