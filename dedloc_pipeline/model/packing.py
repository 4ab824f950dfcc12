"""Pretraining samples from text: ALBERT's sentence-order pairs, packed and written as data shards.

A sample is ``[CLS] A [SEP] B [SEP]``, where A and B are consecutive runs of sentences from one
document; in half of the samples they are swapped (sentence-order label 1) and the model learns to
tell. Shards are written first and the data set's card (DATA.json, with every shard's hash) last:
a data set exists for readers once its card does.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Iterable, Iterator

import numpy as np

from ..storage.bucket import Bucket
from ..storage.layout import DataLayout
from .presets import SPECIAL_TOKENS

CLS, SEP = SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"]


def documents(lines: Iterable[str], lines_per_document: int) -> list[list[str]]:
    """Runs of consecutive lines as documents, for corpora (like a dictionary) without breaks."""
    lines = [x for x in (s.strip() for s in lines) if x]
    return [lines[i:i + lines_per_document] for i in range(0, len(lines), lines_per_document)]


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


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def write_dataset(bucket: Bucket, name: str, tokenizer, docs: list[list[str]], seq_len: int,
                  seed: int = 0, shard_pairs: int = 512, heldout_fraction: float = 0.02,
                  sources: dict | None = None, recipe: dict | None = None) -> dict:
    """Tokenize ``docs``, pack sentence-order pairs, write shards under ``data/{name}/``, card last.

    Documents are shuffled (seeded) and a ``heldout_fraction`` of them set aside for evaluation, so
    no held-out sentence ever reaches a training pair. The card records the training tokens'
    unigram entropy: a masked-LM loss above it means the model does not yet use the context.
    """
    keys, rng = DataLayout(name), np.random.default_rng([seed, 7])
    order = rng.permutation(len(docs))
    n_held = max(1, int(round(heldout_fraction * len(docs)))) if len(docs) > 1 else 0
    flat = [s for d in docs for s in d]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    starts = np.cumsum([0] + [len(d) for d in docs])
    card = {"name": name, "seq_len": seq_len, "seed": seed, "vocab_size": len(tokenizer),
            "tokenizer": keys.tokenizer, "documents": len(docs), "sources": sources or {}, "recipe": recipe or {},
            "objective": "masked LM (15%, dynamic) + sentence-order prediction", "splits": {}}
    for split, doc_ids in (("heldout", order[:n_held]), ("train", order[n_held:])):
        pairs = [p for d in doc_ids for p in sop_pairs(ids[starts[d]:starts[d + 1]], seq_len - 3, rng)]
        if not pairs:
            raise ValueError(f"data set {name!r}: no {split} pairs (too little text)")
        shards = []
        for i in range(0, len(pairs), shard_pairs):
            arrays = pack(pairs[i:i + shard_pairs], seq_len)
            data = _npz(arrays)
            bucket.write_bytes(keys.shard(split, len(shards)), data)
            shards.append({"key": keys.shard(split, len(shards)), "pairs": len(arrays["length"]),
                           "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()})
        if split == "train":
            counts = np.bincount([t for a, b, _ in pairs for t in a + b], minlength=len(tokenizer))
            p = counts[counts > 0] / counts.sum()
            card["unigram_entropy"] = float(-(p * np.log(p)).sum())
            data = _npz({"counts": counts})
            bucket.write_bytes(keys.unigram, data)
            card["unigram"] = {"key": keys.unigram, "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}
        card["splits"][split] = {"pairs": len(pairs), "tokens": int(sum(len(a) + len(b) + 3 for a, b, _ in pairs)),
                                 "swapped": float(np.mean([y for *_, y in pairs])), "shards": shards}
    first = pack(pairs[:2], seq_len)  # a preview of the last split's pairs, for people reading the bucket
    card["preview"] = [tokenizer.decode(row[:n]) for row, n in zip(first["input_ids"], first["length"])]
    card["created_at"] = time.time()
    bucket.write_json(keys.card, card)
    return card
