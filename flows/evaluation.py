"""Downstream evaluation of a committed state, next to the random-init baseline."""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from dedloc_pipeline import evaluation

from flows.common import artifact_key, open_run


@task(retries=1)
def heldout_mlm(bucket: str, run: str, state: int | None, samples: int) -> dict:
    return evaluation.evaluate(open_run(bucket, run), state, samples)


@flow(name="evaluate", log_prints=True)
def evaluate(bucket: str = ".dedloc/bucket", run: str = "demo", round: int | None = None,
             samples: int = 128) -> dict:
    """Score state ``round`` (default: the latest committed) and publish the result."""
    res = heldout_mlm(bucket, run, round, samples)
    create_markdown_artifact(key=artifact_key(run, "eval"), description=f"evaluation of run {run}", markdown=(
        f"| task | dataset | state | loss | random init |\n|---|---|---|---|---|\n"
        f"| {res['task']} | {res['dataset']} | {res['state']} | {res['loss']:.4f} | "
        f"{res['random_init_loss']:.4f} |\n"))
    print(f"{res['task']} at state {res['state']}: loss {res['loss']:.4f} "
          f"(random init {res['random_init_loss']:.4f})")
    return res
