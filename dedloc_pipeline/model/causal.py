"""Causal decoders (Llama, through transformers) for models ten times sahajBERT's and more.

They train on the same Bengali data sets and tokenizer as the ALBERTs, read as running text in
document order (``data.py``), with the next-token loss. As for ALBERT, the loss of a batch is a
sum over samples of each sample's mean, so a batch's gradient is the sum of its parts'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from .presets import PRESETS, SPECIAL_TOKENS, family, model_kwargs


def causal_config(preset: str, seq_len: int | None = None) -> LlamaConfig:
    if preset not in PRESETS or family(preset) != "causal":
        raise ValueError(f"preset {preset!r} is not a causal decoder")
    kw = model_kwargs(preset)
    if seq_len:
        kw["max_position_embeddings"] = max(seq_len, kw["max_position_embeddings"])
    return LlamaConfig(**kw, attention_dropout=0.0, pad_token_id=SPECIAL_TOKENS["pad"],
                       bos_token_id=SPECIAL_TOKENS["cls"], eos_token_id=SPECIAL_TOKENS["sep"])


def build_model(preset: str, seed: int, seq_len: int | None = None) -> LlamaForCausalLM:
    """Same preset and seed give the same initial weights on every machine."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(causal_config(preset, seq_len))
    model.train()
    return model


def sample_losses(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sample's mean next-token loss over its tokens (padding has label -100)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                          reduction="none", ignore_index=-100).view(labels.shape)
    counted = labels != -100
    return (tok * counted).sum(1) / counted.sum(1).clamp(min=1)
