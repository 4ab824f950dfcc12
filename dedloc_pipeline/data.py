"""Training samples, addressed as (stream, index) so every sample a round used can be named.

Each peer reads its own stream (its peer id), so peers never share samples, and a manifest can
list exactly which samples a shard was computed from. The synthetic source stands in for real
text until the tokenized corpus lands: a fixed sparse Markov chain over a Zipf-skewed vocabulary,
learnable, so the loss falls as training works.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .model import SPECIAL_TOKENS

MASK_PROB = 0.15


def _stream_seed(stream: str) -> int:
    return int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")


class SyntheticSource:
    """Deterministic token sequences: the same (seed, stream, index) gives the same sample."""

    n_special = len(SPECIAL_TOKENS)

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, successors: int = 4):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        rng = np.random.default_rng([seed, 1])
        n = vocab_size - self.n_special
        zipf = 1.0 / np.arange(1, n + 1)
        self.unigram = zipf / zipf.sum()
        self.next = rng.choice(n, size=(n, successors), p=self.unigram)

    def sample(self, stream: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, _stream_seed(stream), index])
        n = self.seq_len - 2
        toks = np.empty(n, np.int64)
        toks[0] = rng.choice(len(self.unigram), p=self.unigram)
        picks = rng.integers(0, self.next.shape[1], n)
        for i in range(1, n):
            toks[i] = self.next[toks[i - 1], picks[i]]
        ids = np.concatenate([[SPECIAL_TOKENS["cls"]], toks + self.n_special, [SPECIAL_TOKENS["sep"]]])
        return _mask(ids, rng, self.vocab_size, self.n_special)

    def batch(self, stream: str, start: int, count: int) -> dict[str, torch.Tensor]:
        ids, labels = zip(*(self.sample(stream, i) for i in range(start, start + count)))
        ids_t = torch.from_numpy(np.stack(ids))
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
                "labels": torch.from_numpy(np.stack(labels))}


def _mask(ids: np.ndarray, rng: np.random.Generator, vocab: int, n_special: int):
    """BERT masking (80% [MASK], 10% random, 10% kept), drawn from the sample's own generator."""
    labels = np.full_like(ids, -100)
    cand = np.flatnonzero(ids >= n_special)
    k = max(1, int(round(MASK_PROB * len(cand))))
    pos = rng.choice(cand, size=k, replace=False)
    labels[pos] = ids[pos]
    ids = ids.copy()
    r = rng.random(k)
    ids[pos[r < 0.8]] = SPECIAL_TOKENS["mask"]
    rand = pos[(r >= 0.8) & (r < 0.9)]
    ids[rand] = rng.integers(n_special, vocab, len(rand))
    return ids, labels


def make_source(data: str, vocab_size: int, seq_len: int, seed: int):
    if data == "synthetic":
        return SyntheticSource(vocab_size, seq_len, seed)
    raise ValueError(f"unknown data source {data!r}")


def data_card(data: str, vocab_size: int, seq_len: int, seed: int) -> dict:
    """What a data set is and a few of its samples, for people reading the bucket."""
    source = make_source(data, vocab_size, seq_len, seed)
    preview = [source.sample("preview", i)[0][:16].tolist() for i in range(3)]
    return {"name": data, "kind": "generated on the fly: a sparse Markov chain over a Zipf vocabulary",
            "vocab_size": vocab_size, "seq_len": seq_len, "seed": seed,
            "streams": "one per peer id (disjoint); '~heldout' is reserved for evaluation",
            "preview_input_ids": preview}
