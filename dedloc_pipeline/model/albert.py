"""ALBERT presets (masked LM + sentence-order prediction): sahajBERT's family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AlbertConfig, AlbertForPreTraining

from .presets import PRESETS, SPECIAL_TOKENS, family, model_kwargs


def albert_config(preset: str, seq_len: int | None = None) -> AlbertConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    if family(preset) != "albert":
        raise ValueError(f"preset {preset!r} is not an ALBERT")
    kw = model_kwargs(preset)
    if seq_len:
        kw["max_position_embeddings"] = max(seq_len, kw["max_position_embeddings"])
    return AlbertConfig(**kw, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        classifier_dropout_prob=0.0, pad_token_id=SPECIAL_TOKENS["pad"],
                        bos_token_id=SPECIAL_TOKENS["cls"], eos_token_id=SPECIAL_TOKENS["sep"])


def build_model(preset: str, seed: int, seq_len: int | None = None) -> AlbertForPreTraining:
    """Same preset and seed give the same initial weights on every machine. ALBERT's pretraining
    heads: masked LM, and sentence order (trained only on data made of sentence pairs)."""
    torch.manual_seed(seed)
    model = AlbertForPreTraining(albert_config(preset, seq_len))
    model.train()  # dropout is 0, so train and eval agree; train keeps autograd paths standard
    return model


def pretraining_losses(model: AlbertForPreTraining, batch: dict[str, torch.Tensor]):
    """Per-sample losses: the mean over a sample's masked tokens, and its sentence-order loss
    (None when the batch has no sentence pairs); and the sentence-order logits.

    Only the masked positions (15%) go through the vocabulary projection, the step's largest
    matrix product, instead of every position as ``model(...)`` would.
    """
    out = model.albert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       token_type_ids=batch.get("token_type_ids"))
    labels = batch["labels"]
    masked = labels != -100
    tok = F.cross_entropy(model.predictions(out.last_hidden_state[masked]), labels[masked], reduction="none")
    per_sample = torch.zeros(len(labels), dtype=tok.dtype, device=tok.device).index_add(0, masked.nonzero()[:, 0], tok)
    mlm = per_sample / masked.sum(1).clamp(min=1)
    sop_logits = model.sop_classifier(out.pooler_output)
    sop = batch.get("sentence_order_label")
    return mlm, None if sop is None else F.cross_entropy(sop_logits, sop, reduction="none"), sop_logits


def pretraining_loss_sum(model: AlbertForPreTraining, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over samples of each sample's loss (masked-LM mean, plus sentence order when present).

    Summing per-sample losses (instead of one mean over all masked tokens) makes the gradient of a
    batch the sample-weighted sum of its parts: the invariant that lets peers split a batch.
    """
    mlm, sop, _ = pretraining_losses(model, batch)
    return mlm.sum() if sop is None else mlm.sum() + sop.sum()
