"""Training samples, addressed as (stream, index) so every sample a round used can be named.

Each peer reads its own stream (its peer id), so peers never share samples, and a manifest can
list exactly which samples a shard was computed from.

- ``PairSource``: a tokenized data set in the bucket (``packing``). A stream is the list of data
  blocks its peer claimed, one create-once marker per block under ``runs/{run}/claims/``; blocks
  are the data set's shards in a seeded order per epoch, so every peer gets a disjoint,
  deterministic share, and a joining peer takes the next free block.
- ``SyntheticSource``: a fixed sparse Markov chain over a Zipf-skewed vocabulary, generated on the
  fly; learnable, so protocol tests see the loss fall without any text.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import time

import numpy as np

from ..storage.bucket import Bucket
from ..storage.layout import DataLayout, RunLayout
from .presets import PRESETS, SPECIAL_TOKENS

SYNTHETIC = "synthetic"
HELDOUT = "~heldout"  # no peer id can start with "~": no peer ever trains on it


class DataError(RuntimeError):
    """A data set that is missing, corrupted, or does not fit the run."""

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

    def batch(self, stream: str, start: int, count: int) -> dict:
        ids, labels = zip(*(self.sample(stream, i) for i in range(start, start + count)))
        ids = np.stack(ids)
        return tensors({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": np.stack(labels)})


def tensors(arrays: dict[str, np.ndarray]) -> dict:
    """A batch as torch tensors. torch is imported here, with the first batch: checking a data
    set (``check_data``, run at ``dedloc init``) needs no model."""
    import torch
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


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


class PairSource:
    """Sentence pairs of a tokenized data set; stream ``~heldout`` reads its held-out split."""

    n_special = len(SPECIAL_TOKENS)

    def __init__(self, bucket: Bucket, name: str, run: str, seed: int, owner: str | None = None):
        self.bucket, self.name, self.seed, self.owner = bucket, name, seed, owner
        self.card = read_card(bucket, name)
        self.seq_len, self.vocab_size = self.card["seq_len"], self.card["vocab_size"]
        self.train = self.card["splits"]["train"]["shards"]
        self.heldout = self.card["splits"]["heldout"]["shards"]
        self.keys = RunLayout(run)
        self._claims: dict[int, str] = {}  # block -> peer; markers are create-once, so never stale
        self._shard = functools.lru_cache(maxsize=8)(self._read_shard)

    # blocks and claims
    def _block(self, g: int) -> tuple[int, int]:
        """(epoch, shard) of block g: each epoch visits every training shard once, seeded order."""
        epoch, k = divmod(g, len(self.train))
        return epoch, int(np.random.default_rng([self.seed, epoch]).permutation(len(self.train))[k])

    def _refresh(self) -> None:
        blocks = {self.keys.block_of(n) for n in self.bucket.list(self.keys.claims_dir)} - {None}
        new = {self.keys.claim(g): g for g in blocks if g not in self._claims}  # anything else is no claim
        for key, raw in self.bucket.read_many(list(new)).items():
            if raw is not None:
                try:
                    peer = str(json.loads(raw)["peer"])
                except (ValueError, KeyError, TypeError):
                    peer = "?"  # a malformed claim still takes its block: nobody streams it
                self._claims[new[key]] = peer

    def blocks(self, stream: str) -> list[int]:
        return sorted(g for g, p in self._claims.items() if p == stream)

    def claim(self) -> int:
        """Take the lowest free block for this source's owner (create-once: one winner per block)."""
        while True:
            self._refresh()
            g = min(set(range(len(self._claims) + 1)) - set(self._claims))
            if self.bucket.create_json(self.keys.claim(g), {"peer": self.owner, "time": time.time()}):
                self._claims[g] = self.owner
                return g

    def locate(self, stream: str, index: int) -> tuple[int, int, int]:
        """(epoch, shard, position) of sample ``index`` of ``stream``."""
        refreshed = False
        while True:
            pos = index
            for g in self.blocks(stream):
                epoch, d = self._block(g)
                if pos < self.train[d]["pairs"]:
                    order = np.random.default_rng([self.seed, epoch, d]).permutation(self.train[d]["pairs"])
                    return epoch, d, int(order[pos])
                pos -= self.train[d]["pairs"]
            if stream == self.owner:
                self.claim()
            elif not refreshed:
                self._refresh()
                refreshed = True
            else:
                raise DataError(f"stream {stream!r} has no sample {index}: its claimed blocks end before it")

    def _read_shard(self, split: str, d: int) -> dict[str, np.ndarray]:
        meta = (self.train if split == "train" else self.heldout)[d]
        raw = self.bucket.read_bytes(meta["key"])
        if raw is None or hashlib.blake2b(raw, digest_size=16).hexdigest() != meta["blake2b"]:
            raise DataError(f"data shard {meta['key']} is missing or does not match its hash in DATA.json")
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    # samples
    def sample(self, stream: str, index: int) -> dict[str, np.ndarray]:
        if stream == HELDOUT:
            sizes = np.cumsum([0] + [s["pairs"] for s in self.heldout])
            index %= int(sizes[-1])
            d = int(np.searchsorted(sizes, index, side="right") - 1)
            epoch, split, pos = -1, "heldout", index - int(sizes[d])
        else:
            (epoch, d, pos), split = self.locate(stream, index), "train"
        z = self._shard(split, d)
        n = int(z["length"][pos])
        ids = z["input_ids"][pos].astype(np.int64)
        types = np.zeros_like(ids)
        types[int(z["b_start"][pos]):n] = 1
        masked, labels = _mask(ids, np.random.default_rng([self.seed, epoch + 1, d, pos]), self.vocab_size,
                               self.n_special)
        return {"input_ids": masked, "labels": labels, "token_type_ids": types,
                "attention_mask": (np.arange(len(ids)) < n).astype(np.int64),
                "sentence_order_label": np.int64(z["sentence_order_label"][pos])}

    def batch(self, stream: str, start: int, count: int) -> dict:
        rows = [self.sample(stream, i) for i in range(start, start + count)]
        return tensors({k: np.stack([r[k] for r in rows]) for k in rows[0]})


def read_card(bucket: Bucket, name: str) -> dict:
    card = bucket.read_json(DataLayout(name).card)
    if card is None:
        raise DataError(f"no data set {name!r} in {bucket.url} (run the tokenize flow first)")
    return card


def unigram_log_probs(bucket: Bucket, name: str, vocab_size: int) -> np.ndarray:
    """log p(token) over the training split, add-one smoothed over the model's whole vocabulary."""
    meta = read_card(bucket, name).get("unigram")
    raw = bucket.read_bytes(meta["key"]) if meta else None
    if raw is None or hashlib.blake2b(raw, digest_size=16).hexdigest() != meta["blake2b"]:
        raise DataError(f"data set {name!r} has no intact unigram counts (make it again with the tokenize flow)")
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        counts = np.zeros(vocab_size)
        counts[:len(z["counts"])] = z["counts"][:vocab_size]
    return np.log((counts + 1) / (counts.sum() + vocab_size)).astype(np.float32)


def check_data(bucket: Bucket, data: str, preset: str, seq_len: int) -> None:
    """A run may use a data set only if its sequences and vocabulary fit the model."""
    if data == SYNTHETIC:
        return
    card = read_card(bucket, data)
    if card["seq_len"] != seq_len:
        raise DataError(f"data set {data!r} is packed for sequence length {card['seq_len']}, the run uses {seq_len}")
    if card["vocab_size"] > PRESETS[preset]["vocab_size"]:
        raise DataError(f"data set {data!r} has {card['vocab_size']} tokens; preset {preset!r} "
                        f"embeds only {PRESETS[preset]['vocab_size']}")


def make_source(run, owner: str | None = None):
    """The run's data: ``owner`` is the peer whose stream may claim new blocks."""
    c = run.config
    if c.data == SYNTHETIC:
        return SyntheticSource(PRESETS[c.preset]["vocab_size"], run.seq_len, c.seed)
    return PairSource(run.bucket, c.data, run.name, c.seed, owner)


def data_card(vocab_size: int, seq_len: int, seed: int) -> dict:
    """What the synthetic data set is and a few of its samples, for people reading the bucket."""
    source = SyntheticSource(vocab_size, seq_len, seed)
    preview = [source.sample("preview", i)[0][:16].tolist() for i in range(3)]
    return {"name": SYNTHETIC, "kind": "generated on the fly: a sparse Markov chain over a Zipf vocabulary",
            "vocab_size": vocab_size, "seq_len": seq_len, "seed": seed,
            "streams": "one per peer id (disjoint); '~heldout' is reserved for evaluation",
            "preview_input_ids": preview}
