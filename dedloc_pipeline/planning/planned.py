"""A run as planned: its config and its parameter count, without a bucket or a model.

The vectors a run moves and how they are chunked and cut into parts are ``Run``'s own
(``grad_format``, ``delta_format``, ``dense_format``, ``part_chunks``); they read only the config
and the length of the flat vector. ``PlannedRun`` gives them that length from the preset's
arithmetic (``n_params``) instead of building the model, so planning stays torch-free and can
never disagree with the run it plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.presets import PRESETS, family
from ..protocol.config import RunConfig
from ..protocol.run import Run


def n_params(preset: str, seq_len: int | None = None) -> int:
    """Parameters of a preset's ALBERT (masked-LM and sentence-order heads, one shared layer), as
    ``model/albert.py`` builds it: the MLM decoder's weight is the word embedding and its bias
    ``predictions.bias``, so both count once. Positions: the preset's, or ``seq_len`` if longer.
    A causal decoder's: ``causal_params``."""
    c = PRESETS[preset]
    if family(preset) == "causal":
        return causal_params(preset)
    v, e, h, i = c["vocab_size"], c["embedding_size"], c["hidden_size"], c["intermediate_size"]
    positions = max(seq_len or 0, c["max_position_embeddings"])
    embeddings = (v + positions + 2) * e + 2 * e  # words, positions, 2 token types, LayerNorm
    mapping = e * h + h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h  # attention, its norm, FFN, norm
    pooler = h * h + h
    mlm_head = v + (h * e + e) + 2 * e
    sop_head = 2 * h + 2
    return embeddings + mapping + layer + pooler + mlm_head + sop_head


def causal_params(preset: str) -> int:
    """A Llama preset's parameters, as ``model/causal.py`` builds it (rotary positions: none
    stored; no biases; the output projection is the embedding when tied)."""
    c = PRESETS[preset]
    v, h, i, layers = c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q and o, k and v, the gated MLP, 2 norms
    return v * h * (1 if c["tie_word_embeddings"] else 2) + layers * layer + h


@dataclass(frozen=True)
class Length:
    """What ``Run``'s vector formats read of the model's flat layout: its number of elements."""

    n: int


class PlannedRun(Run):
    """``config`` as a ``Run`` of ``n`` parameters (default: the preset's), for its vector
    formats and parts only: it has no bucket and builds no model."""

    def __init__(self, config: RunConfig, n: int | None = None):
        super().__init__(None, config.run, config)
        self.flat = Length(n_params(config.preset, config.seq_len) if n is None else n)
