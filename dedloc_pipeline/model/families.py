"""A preset's model family, and the one loss each family trains and is scored on.

Everything that builds or trains a model goes through here (workers, the validator, held-out
scoring), so an ALBERT and a causal decoder run on the same protocol unchanged.
"""

from __future__ import annotations

import torch

from . import albert, causal
from .presets import family


def build_model(preset: str, seed: int, seq_len: int | None = None) -> torch.nn.Module:
    module = causal if family(preset) == "causal" else albert
    return module.build_model(preset, seed, seq_len)


def losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """(each sample's main loss, sentence-order losses or None, their logits or None): the masked
    LM's mean for an ALBERT, the next-token mean for a causal decoder."""
    if model.config.model_type == "albert":
        return albert.pretraining_losses(model, batch)
    return causal.sample_losses(model, batch), None, None


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over samples of each sample's loss: a batch's gradient is the sum of its parts'."""
    if model.config.model_type == "albert":
        return albert.pretraining_loss_sum(model, batch)
    return causal.sample_losses(model, batch).sum()
