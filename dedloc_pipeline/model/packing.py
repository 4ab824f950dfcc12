"""Pretraining samples from text: ALBERT's sentence-order pairs, packed as a data shard's arrays.

A sample is ``[CLS] A [SEP] B [SEP]``, where A and B are consecutive runs of sentences from one
document; in half of the samples they are swapped (sentence-order label 1) and the model learns to
tell. dataset/build.py writes them as shards, and the data set's card (DATA.json, with every
shard's hash) last: a data set exists for readers once its card does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .presets import SPECIAL_TOKENS

CLS, SEP = SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"]


def sop_pairs(doc: list[list[int]], max_tokens: int, rng: np.random.Generator
              ) -> Iterator[tuple[list[int], list[int], int]]:
    """(A, B, label) from one tokenized document: sentences gathered until ``max_tokens``, cut at a
    random sentence boundary (a lone sentence at its middle); label 1 means B came first."""
    chunk: list[list[int]] = []
    length = 0
    for i, sent in enumerate(doc):
        if sent:
            chunk.append(sent)
            length += len(sent)
        if chunk and (i == len(doc) - 1 or length >= max_tokens):
            if len(chunk) >= 2:
                cut = int(rng.integers(1, len(chunk)))
                a, b = sum(chunk[:cut], []), sum(chunk[cut:], [])
            else:
                a, b = chunk[0][:len(chunk[0]) // 2], chunk[0][len(chunk[0]) // 2:]
            chunk, length = [], 0
            while len(a) + len(b) > max_tokens:  # trim the longer side, at the end farther from the cut
                if len(a) > len(b):
                    a = a[1:]
                else:
                    b = b[:-1]
            if not a or not b:
                continue
            swap = rng.random() < 0.5
            yield (b, a, 1) if swap else (a, b, 0)


def pack(pairs: list[tuple[list[int], list[int], int]], seq_len: int) -> dict[str, np.ndarray]:
    """Pairs as fixed-width arrays: token ids (padded with 0), where segment B starts, lengths, labels."""
    n = len(pairs)
    ids = np.zeros((n, seq_len), np.int32)
    b_start, length, label = (np.zeros(n, np.int32) for _ in range(3))
    for i, (a, b, y) in enumerate(pairs):
        row = [CLS, *a, SEP, *b, SEP]
        ids[i, :len(row)] = row
        b_start[i], length[i], label[i] = len(a) + 2, len(row), y
    return {"input_ids": ids, "b_start": b_start, "length": length, "sentence_order_label": label}
