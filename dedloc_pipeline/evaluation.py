"""Evaluation of committed states, always next to the same model at random initialisation.

Until the Bengali downstream tasks land, a state is scored by its masked-LM loss on a held-out
stream of the run's own data source (a stream no peer trains on).
"""

from __future__ import annotations

import math
import time

import torch

from .data import make_source
from .model import FlatLayout, mlm_loss_sum
from .run import Run

HELDOUT = "~heldout"  # no peer id can start with "~": no peer ever trains on it


def heldout_loss(run: Run, params, samples: int, micro_batch: int = 16) -> float:
    model = run.build_model()
    FlatLayout(model).set(params)
    model.eval()
    source = make_source(run.config.data, model.config.vocab_size, run.seq_len, run.config.seed)
    total = 0.0
    with torch.no_grad():
        for start in range(0, samples, micro_batch):
            n = min(micro_batch, samples - start)
            total += float(mlm_loss_sum(model, source.batch(HELDOUT, start, n)))
    return total / samples


def evaluate(run: Run, state: int | None = None, samples: int = 128) -> dict:
    """Score a committed state (default: the latest) and record it under ``evals/``."""
    state = run.latest() if state is None else state
    loss = heldout_loss(run, run.load_params(state), samples)
    baseline = heldout_loss(run, run.load_params(0), samples)
    result = {"state": state, "task": "mlm-heldout", "dataset": f"{run.config.data} held-out stream",
              "samples": samples, "loss": loss, "perplexity": math.exp(min(loss, 50)),
              "random_init_loss": baseline, "evaluated_at": time.time()}
    run.bucket.write_json(run.keys.eval(state, "mlm-heldout"), result)
    return result
