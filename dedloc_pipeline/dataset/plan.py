"""Which document goes where, decided from its text alone: kept or a duplicate, held out or
trained on, in the tokenizer's sample, in which partition, and its pairs' random draws.

Every decision is a function of the document's digest and the recipe's seed, never of the file
it came in, its place there or how the work was split, so the data set is the same however the
corpus is cut into files, tasks or resumed runs. A document is identified by the BLAKE2b digest
of its text (exact duplicates share it: one is kept); the seeded values are a keyed BLAKE2b of
that digest, read as four 64-bit numbers.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

DIGEST = 16  # bytes of a document's digest
_KEYS = ("order", "heldout", "partition", "draws")  # the seeded 64-bit values, in this order


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=DIGEST).digest()


def seeded(digests: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The seeded values of each digest (rows of ``DIGEST`` bytes): ``order`` (the canonical
    order: which documents ``max_documents`` and the tokenizer's sample take first, and how a
    partition's pairs are sorted before its shuffle), ``heldout``, ``partition`` and ``draws``
    (the seed of its sentence-order pairs' random cuts and swaps)."""
    key = seed.to_bytes(8, "little", signed=True)
    raw = b"".join(hashlib.blake2b(bytes(d), digest_size=8 * len(_KEYS), key=key).digest() for d in digests)
    values = np.frombuffer(raw, dtype="<u8").reshape(-1, len(_KEYS)) if raw else np.zeros((0, len(_KEYS)), "<u8")
    return {k: values[:, i].copy() for i, k in enumerate(_KEYS)}


def plan(digests: list[np.ndarray], sizes: list[np.ndarray], seed: int, heldout_fraction: float,
         max_documents: int | None, sample_bytes: int, partition_bytes: int) -> tuple[list[dict], dict]:
    """Each piece's decisions (``keep``, ``heldout``, ``sample``: booleans per document;
    ``partition``, ``order``, ``draws``: numbers) and the summary (documents read, duplicates,
    kept, held out, text bytes kept, partitions). ``digests[i]``/``sizes[i]``: piece i's
    documents' digests and UTF-8 sizes, in order."""
    counts = [len(d) for d in digests]
    allv = np.concatenate(digests) if digests else np.zeros((0, DIGEST), np.uint8)
    size = np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)
    n = len(allv)
    keep = np.zeros(n, bool)
    if n:
        _, first = np.unique(np.ascontiguousarray(allv).view(f"V{DIGEST}").ravel(), return_index=True)
        keep[first] = True  # exact duplicates: the first met is kept (they make the same pairs)
    dups = n - int(keep.sum())
    vals = seeded(allv, seed)
    if max_documents is not None and keep.sum() > max_documents:  # the first in the canonical order
        kept = np.flatnonzero(keep)
        keep[kept[np.argsort(vals["order"][kept], kind="stable")[max_documents:]]] = False
    held = keep & (vals["heldout"] < np.uint64(int(heldout_fraction * 2.0 ** 64)))
    kept = np.flatnonzero(keep)
    if len(kept) >= 2 and not held.any():  # a held-out split always exists: the lowest draw
        held[kept[np.argmin(vals["heldout"][kept])]] = True
    if len(kept) >= 2 and held[kept].all():
        held[kept[np.argmax(vals["heldout"][kept])]] = False
    sample = np.zeros(n, bool)
    by_order = kept[np.argsort(vals["order"][kept], kind="stable")]
    within = np.cumsum(size[by_order]) <= sample_bytes
    within[:1] = True  # the first document, however long
    sample[by_order[within]] = True
    text_bytes = int(size[keep].sum())
    partitions = max(1, math.ceil(text_bytes / partition_bytes))
    part = (vals["partition"] % np.uint64(partitions)).astype(np.uint32)
    out, at = [], 0
    for c in counts:
        sl = slice(at, at + c)
        out.append({"keep": keep[sl], "heldout": held[sl], "sample": sample[sl], "partition": part[sl],
                    "order": vals["order"][sl], "draws": vals["draws"][sl]})
        at += c
    summary = {"documents_read": n, "duplicates": dups, "documents": int(keep.sum()), "heldout": int(held.sum()),
               "text_bytes": text_bytes, "sample_bytes": int(size[sample].sum()), "partitions": partitions}
    return out, summary
