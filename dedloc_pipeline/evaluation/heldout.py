"""Evaluation of committed states, always next to the same model at random initialisation.

A state is scored on the data set's held-out split, which no peer trains on: an ALBERT by its
masked-LM loss (and sentence-order accuracy, when the data has sentence pairs), a causal decoder
by its next-token loss (and so its perplexity).
"""

from __future__ import annotations

import math
import time

import torch

from ..model.data import HELDOUT, SYNTHETIC, make_source, read_card
from ..model.families import losses as sample_losses
from ..model.flat import FlatLayout
from ..model.presets import family
from ..protocol.run import Run


def task_of(run: Run) -> str:
    """The held-out score's name: ``mlm-heldout`` for an ALBERT, ``lm-heldout`` for a causal decoder."""
    return "lm-heldout" if family(run.config.preset) == "causal" else "mlm-heldout"


def heldout_scores(run: Run, params, samples: int, micro_batch: int = 16) -> tuple[float, float | None]:
    """(mean loss, sentence-order accuracy or None) over ``samples`` held-out samples."""
    model = run.build_model()
    FlatLayout(model).set(params)
    model.eval()
    source = make_source(run)
    mlm, right, pairs = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, samples, micro_batch):
            batch = source.batch(HELDOUT, start, min(micro_batch, samples - start))
            losses, sop, sop_logits = sample_losses(model, batch)
            mlm += float(losses.sum())
            if sop is not None:
                right += int((sop_logits.argmax(-1) == batch["sentence_order_label"]).sum())
                pairs += len(sop)
    return mlm / samples, (right / pairs if pairs else None)


def evaluate(run: Run, state: int | None = None, samples: int = 128,
             random_init: tuple[float, float | None] | None = None) -> dict:
    """Score a committed state (default: the latest) and record it under ``evals/``;
    ``random_init``, state 0's (loss, sentence-order accuracy) if already scored."""
    state = run.latest() if state is None else state
    loss, sop = heldout_scores(run, run.load_params(state), samples)
    if random_init is None:
        random_init = (loss, sop) if state == 0 else heldout_scores(run, run.load_params(0), samples)
    result = {"state": state, "task": task_of(run), "dataset": f"{run.config.data} held-out split",
              "samples": samples, "loss": loss, "perplexity": math.exp(min(loss, 50)),
              "random_init_loss": random_init[0], "sop_accuracy": sop, "random_init_sop_accuracy": random_init[1],
              "unigram_entropy": None if run.config.data == SYNTHETIC
              else read_card(run.bucket, run.config.data).get("unigram_entropy"),
              "evaluated_at": time.time()}
    run.bucket.write_json(run.keys.eval(state, result["task"]), result)
    return result


def curve(run: Run, samples: int = 128) -> list[dict]:
    """The held-out loss of every kept state, each recorded as ``evaluate`` records one."""
    first = evaluate(run, 0, samples)
    random_init = (first["loss"], first["sop_accuracy"])
    return [first] + [evaluate(run, s, samples, random_init) for s in run.kept_states()[1:]]


DOWNSTREAM = ("ner", "news")  # WikiANN-bn NER and Soham news classification, or their stand-ins


def default_tasks(run: Run) -> list[str]:
    """The held-out score, and fine-tuning an ALBERT trained on text on the downstream tasks."""
    text_encoder = family(run.config.preset) == "albert" and run.config.data != SYNTHETIC
    return [task_of(run)] + (list(DOWNSTREAM) if text_encoder else [])


def task_data(task: str, source: str = "offline", corpus_dir: str = ".dedloc/corpus"):
    """The labelled set of ``task``: from the hub (the real benchmarks) or built offline."""
    from . import downstream
    _check(task, source)
    if source == "hub":
        return downstream.wikiann_bn() if task == "ner" else downstream.soham_bn()
    return downstream.offline_ner() if task == "ner" else downstream.offline_news(corpus_dir)


def _check(task: str, source: str) -> None:
    if task not in DOWNSTREAM or source not in ("offline", "hub"):
        raise ValueError(f"unknown task {task!r} from {source!r}: tasks {', '.join(DOWNSTREAM)}; "
                         "sources offline, hub")


def finetune_eval(run: Run, state: int | None, task: str, source: str = "offline",
                  corpus_dir: str = ".dedloc/corpus", **finetune) -> dict:
    """Fine-tune committed ``state`` on ``task`` next to random init; recorded under ``evals/``."""
    from . import downstream
    from .export import model_at, run_tokenizer
    _check(task, source)
    if family(run.config.preset) != "albert":
        raise ValueError(f"run {run.name!r} trains a causal decoder: the downstream tasks fine-tune an ALBERT "
                         "encoder (score it with lm-heldout)")
    state = run.latest() if state is None else state
    tok = run_tokenizer(run)
    if tok is None:
        raise ValueError(f"run {run.name!r} trains on synthetic data: it has no tokenizer for {task!r}")
    model = model_at(run, state)
    result = downstream.compare(task_data(task, source, corpus_dir), tok, model.config,
                                model.albert.state_dict(), seed=run.config.seed, **finetune)
    result.update(state=state, evaluated_at=time.time())
    run.bucket.write_json(run.keys.eval(state, task), result)
    return result
