"""The round loop as Prefect flows: each round is its own subflow of tens of tasks.

The loop and its steps are the library's round engine (``dedloc_pipeline/organizer/scheduler.py``),
the same that ``dedloc aggregate`` drives; this module only makes the steps tasks (with retries),
maps the aggregation tasks (flows/aggregators.py) over the parts, and publishes artifacts.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from dedloc_pipeline.monitoring import report
from dedloc_pipeline.monitoring.status import status
from dedloc_pipeline.organizer import ledger, scheduler as engine
from dedloc_pipeline.organizer.close_out import CloseOut, close_out
from dedloc_pipeline.organizer.referee import Settlement
from dedloc_pipeline.protocol.close import close_summary, round_close
from dedloc_pipeline.protocol.config import recipe_config
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket
from flows.aggregators import apply_part, reduce_part, run_parts
from flows.common import artifact_key, dask_address, open_run, scheduler, task_runner


@task(retries=3, retry_delay_seconds=2)
def wait_close(bucket: str, run: str, r: int, poll_s: float | None, max_wait_s: float,
               volunteers: bool = False) -> dict | None:
    """Round r's CLOSE in brief, or None if the run was stopped or nothing closed in ``max_wait_s``."""
    close = scheduler(bucket, run, poll_s, volunteers).wait_close(r, time.monotonic() + max_wait_s)
    return None if close is None else close_summary(close)


@task(retries=1, retry_delay_seconds=2)
def settle(bucket: str, run: str, r: int, poll_s: float | None) -> Settlement:
    """The parts round r's volunteer aggregators settle by agreeing, until its deadline."""
    return scheduler(bucket, run, poll_s, True).settle(round_close(open_run(bucket, run), r, counted=False))


@task(retries=3, retry_delay_seconds=2)
def flag_liars(bucket: str, run: str, r: int, poll_s: float | None, settled: Settlement) -> None:
    scheduler(bucket, run, poll_s, True).flag_liars(round_close(open_run(bucket, run), r, counted=False), settled)


@task(retries=3, retry_delay_seconds=2)
def commit(bucket: str, run: str, r: int, stages: dict | None = None) -> dict:
    c = ledger.commit(open_run(bucket, run), r, stages)
    return {k: c[k] for k in ("state", "round", "samples", "loss", "contributors", "closed_at", "committed_at")}


@task(retries=2, retry_delay_seconds=2)
def publish_report(bucket: str, run: str) -> dict:
    """The run's HTML report into the bucket; returns the leaderboard and the summary for the artifacts."""
    rn = open_run(bucket, run)
    s = status(rn)
    key = report.publish(rn, report.render(rn, s))
    return {"leaderboard": report.leaderboard_rows(s), "markdown": report.markdown(s, f"{rn.bucket.url}/{key}")}


@flow(name="dedloc-round", log_prints=True)
def round_flow(bucket: str, run: str, r: int, poll_s: float | None = None, max_wait_s: float = 300.0,
               runner: str = "threads") -> dict | None:
    """Close round r, then end it as the engine does (``close_out``), each step a task: reduce and
    apply every part in parallel, commit state r+1. With runner ``volunteers`` the parts go to
    volunteer aggregators first, and only those they do not settle by the deadline are reduced
    and applied here."""
    volunteers = runner == "volunteers"
    close = wait_close(bucket, run, r, poll_s, max_wait_s, volunteers)
    if close is None:
        return None

    def parts(task, ks: list[int]) -> None:
        """``task`` over parts ``ks`` at once, all finished on return."""
        if runner == "task-workers":  # background task runs that task workers take (flows/aggregators.py)
            run_parts(task, bucket, run, r, ks)
        else:
            task.map(bucket, run, r, ks).result()
    summary = close_out(open_run(bucket, run).n_parts, CloseOut(
        settle=(lambda: settle(bucket, run, r, poll_s)) if volunteers else Settlement,
        reduce=lambda ks: parts(reduce_part, ks),
        apply=lambda ks: parts(apply_part, ks),
        flag_liars=(lambda settled: flag_liars(bucket, run, r, poll_s, settled)) if volunteers else lambda _: None,
        commit=lambda stages: commit(bucket, run, r, stages)))
    summary["duration_s"] = summary["committed_at"] - summary["closed_at"]
    create_table_artifact(
        key=artifact_key(run, "round"), description=f"round {r} of run {run}",
        table=[{"round": r, "samples": summary["samples"], "shards": close["shards"],
                "rejected": close["rejected"], "contributors": ", ".join(summary["contributors"]),
                "loss": round(summary["loss"], 4), "reduce+commit s": round(summary["duration_s"], 2)}])
    return summary


@flow(name="pretrain", log_prints=True)
def pretrain(bucket: str = ".dedloc/bucket", run: str = "demo", rounds: int | None = 10,
             max_minutes: float | None = None, config: dict | None = None, poll_s: float | None = None,
             parallel: int = 2, runner: str = "threads", dask_scheduler: str | None = None) -> dict:
    """Schedule rounds until state ``rounds`` is committed, ``max_minutes`` pass, or STOP.

    Creates the run from ``config`` (RunConfig fields over the preset's recipe) if the bucket has
    none. Restartable: it continues from whatever the bucket holds.
    """
    log = get_run_logger()
    if config is not None:
        init_run(Bucket(bucket), recipe_config(run, **config))
    sched = scheduler(bucket, run, poll_s, runner == "volunteers")  # the rounds' own: one lease holder
    first = sched.run.latest()
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    progress = create_progress_artifact(0.0, key=artifact_key(run, "progress"),
                                        description=f"run {run}: rounds toward state {rounds}")
    summaries: list[dict] = []
    with dask_address(runner, parallel, dask_scheduler) as address:
        one_round = round_flow.with_options(task_runner=task_runner(runner, parallel, address))
        while (reason := engine.stop_reason(snap := sched.poll(), rounds, deadline, time.monotonic())) is None:
            s = one_round(bucket, run, snap.state, poll_s=poll_s, runner=runner)
            if s is None:  # no round closed within the wait: check the stop rules again
                continue
            summaries.append(s)
            log.info("state %d committed: loss %.4f from %d samples", s["state"], s["loss"], s["samples"])
            if rounds and rounds > first:
                update_progress_artifact(progress, 100.0 * min(1.0, (s["state"] - first) / (rounds - first)))
    sched.end(snap.state, reason)
    published = publish_report(bucket, run)
    create_table_artifact(key=artifact_key(run, "leaderboard"), table=published["leaderboard"],
                          description=f"contributors of run {run}: samples counted in committed rounds")
    create_markdown_artifact(key=artifact_key(run, "report"), markdown=published["markdown"],
                             description=f"run {run}: loss, last rounds, and where its HTML report is")
    return {"run": run, "state": sched.run.latest(), "rounds_done": len(summaries), "stopped_by": reason,
            "losses": [s["loss"] for s in summaries]}
