"""ALBERT presets (masked LM + sentence-order prediction) and the flat vector the protocol exchanges.

The protocol sees the model as one float32 vector; ``FlatLayout`` maps it to named tensors in a
fixed (sorted) order, so every peer and aggregator cuts it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AlbertConfig, AlbertForPreTraining

from .presets import PRESETS, SPECIAL_TOKENS



def albert_config(preset: str, seq_len: int | None = None) -> AlbertConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
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


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int
    size: int
    decay: bool  # weight decay applies (not to biases and LayerNorm)


class FlatLayout:
    """Named tensors <-> one flat float32 vector."""

    def __init__(self, model: torch.nn.Module):
        self.tensors: list[Tensor] = []
        offset = 0
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            decay = p.ndim > 1 and "LayerNorm" not in name and "norm" not in name.lower()
            self.tensors.append(Tensor(name, tuple(p.shape), offset, p.numel(), decay))
            offset += p.numel()
        self.n = offset
        self._params = dict(model.named_parameters())

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def pieces(self, lo: int, hi: int):
        """(tensor, start, stop) for every tensor overlapping [lo, hi), in flat coordinates."""
        for t in self.tensors:
            a, b = max(lo, t.offset), min(hi, t.offset + t.size)
            if a < b:
                yield t, a, b

    def get(self) -> np.ndarray:
        out = np.empty(self.n, np.float32)
        for t in self.tensors:
            out[t.offset:t.offset + t.size] = self._params[t.name].detach().reshape(-1).cpu().numpy()
        return out

    def set(self, flat: np.ndarray) -> None:
        with torch.no_grad():
            for t in self.tensors:
                src = torch.from_numpy(np.ascontiguousarray(flat[t.offset:t.offset + t.size]))
                self._params[t.name].copy_(src.view(t.shape))

    def grad(self) -> np.ndarray:
        out = np.zeros(self.n, np.float32)
        for t in self.tensors:
            g = self._params[t.name].grad
            if g is not None:
                out[t.offset:t.offset + t.size] = g.reshape(-1).cpu().numpy()
        return out


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
