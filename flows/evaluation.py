"""Evaluation of a committed state, each score next to the same model from random initialisation."""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from dedloc_pipeline.evaluation import heldout as evaluation
from flows.common import artifact_key, open_run


@task(retries=1)
def heldout_loss(bucket: str, run: str, state: int | None, samples: int) -> dict:
    return evaluation.evaluate(open_run(bucket, run), state, samples)


@task(retries=1)
def heldout_curve(bucket: str, run: str, samples: int) -> list[dict]:
    return evaluation.curve(open_run(bucket, run), samples)


@task
def finetune(bucket: str, run: str, state: int, name: str, source: str, corpus_dir: str, options: dict) -> dict:
    return evaluation.finetune_eval(open_run(bucket, run), state, name, source, corpus_dir, **options)


def _row(res: dict) -> tuple[str, str, str, float, float]:
    if res["task"].endswith("heldout"):
        return res["task"], res["dataset"], "loss (lower is better)", res["loss"], res["random_init_loss"]
    return res["task"], res["source"], res["metric"], res["pretrained"]["test"], res["random_init"]["test"]


@flow(name="evaluate", log_prints=True)
def evaluate(bucket: str = ".dedloc/bucket", run: str = "demo", round: int | None = None,
             samples: int = 128, tasks: list[str] | None = None, source: str = "offline",
             corpus_dir: str = ".dedloc/corpus", finetune_options: dict | None = None,
             curve: bool = False) -> dict:
    """Score state ``round`` (default: the latest committed): the held-out loss (masked-LM, or
    next-token for a causal decoder), and fine-tuning on ``tasks`` (default: NER and news
    classification when the run trains an ALBERT on text). ``source``
    offline uses the project's stand-in sets; hub the real WikiANN-bn and Soham news.
    ``finetune_options`` go to ``downstream.finetune`` (epochs, lr, max_train, seq_len, ...).
    ``curve`` also scores every state the run keeps, for the learning curve (the result's
    ``curve``)."""
    rn = open_run(bucket, run)
    state = rn.latest() if round is None else round
    if tasks is None:
        tasks = evaluation.default_tasks(rn)[1:]
    results: dict = {"curve": heldout_curve(bucket, run, samples)} if curve else {}
    scored = [c for c in results.get("curve", []) if c["state"] == state]
    results[evaluation.task_of(rn)] = scored[0] if scored else heldout_loss(bucket, run, state, samples)
    for name in tasks:  # one after another: each fine-tuning already uses every core
        results[name] = finetune(bucket, run, state, name, source, corpus_dir, finetune_options or {})
    rows = [_row(r) for name, r in results.items() if name != "curve"]
    create_markdown_artifact(key=artifact_key(run, "eval"), description=f"evaluation of run {run}", markdown=(
        f"State {state} of run {run}\n\n| task | data | metric | pretrained | random init |\n|---|---|---|---|---|\n"
        + "".join(f"| {t} | {d} | {m} | {a:.4f} | {b:.4f} |\n" for t, d, m, a, b in rows)))
    for t, d, m, a, b in rows:
        print(f"{t} ({d}) at state {state}: {m} {a:.4f} (random init {b:.4f})")
    return {"state": state, **results}
