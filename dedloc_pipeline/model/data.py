"""Training samples, addressed as (stream, index) so every sample a round used can be named.

Each peer reads its own stream (its peer id), and a manifest can list exactly which samples a
shard was computed from. A sample is masked for an ALBERT (BERT masking, drawn from the sample's
own generator) and running text for a causal decoder (every token its own label).

- ``PairSource``: a tokenized data set in the bucket (``packing``). A stream visits the data
  set's shards epoch after epoch in an order seeded by the run's seed and the stream's name, so
  no other volunteer can steer what it trains on and nobody needs to read anything to replay it.
- ``SyntheticSource``: a fixed sparse Markov chain over a Zipf-skewed vocabulary, generated on the
  fly; learnable, so protocol tests see the loss fall without any text.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json

import numpy as np

from ..storage.bucket import Bucket
from ..storage.layout import DataLayout
from .presets import PRESETS, SPECIAL_TOKENS, family

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

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, successors: int = 4, causal: bool = False):
        self.vocab_size, self.seq_len, self.seed, self.causal = vocab_size, seq_len, seed, causal
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
        return (ids, ids.copy()) if self.causal else _mask(ids, rng, self.vocab_size, self.n_special)

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
    """Sentence pairs of a tokenized data set; stream ``~heldout`` reads its held-out split.

    A stream's order is a function of the run's seed and the stream's name alone: each epoch
    visits every training shard once, in an order seeded by (seed, stream, epoch), and a shard's
    pairs in an order seeded by that and the shard. Nothing another volunteer writes can steer
    it (the claim markers this replaced could be created in bulk and overwritten), a joiner reads
    nothing to find its share, any sample of any stream is located in O(log shards), and anyone
    can replay which samples a shard was computed from. Streams are independent samples of the
    data set, not disjoint shares of it: two volunteers meet the same pair in an epoch as often
    as two independent shuffles would (for a corpus much larger than a run, rarely)."""

    n_special = len(SPECIAL_TOKENS)

    def __init__(self, bucket: Bucket, name: str, seed: int, pinned: str | None = None, causal: bool = False):
        self.bucket, self.name, self.seed, self.causal = bucket, name, seed, causal
        self.card = read_card(bucket, name, pinned)
        self.seq_len, self.vocab_size = self.card["seq_len"], self.card["vocab_size"]
        self.train = self.card["splits"]["train"]["shards"]
        self.heldout = self.card["splits"]["heldout"]["shards"]
        self.pairs = sum(s["pairs"] for s in self.train)
        self._shard = functools.lru_cache(maxsize=8)(self._read_shard)
        self._epoch = functools.lru_cache(maxsize=64)(self._epoch_order)

    def _epoch_order(self, stream: str, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(training shards in the order ``stream`` visits them in ``epoch``, where each starts)."""
        order = np.random.default_rng([self.seed, _stream_seed(stream), epoch]).permutation(len(self.train))
        return order, np.cumsum([0] + [self.train[d]["pairs"] for d in order])

    def locate(self, stream: str, index: int) -> tuple[int, int, int]:
        """(epoch, shard, position) of sample ``index`` of ``stream``."""
        if index < 0:
            raise DataError(f"stream {stream!r} has no sample {index}")
        epoch, k = divmod(index, self.pairs)
        order, starts = self._epoch(stream, epoch)
        i = int(np.searchsorted(starts, k, side="right") - 1)
        d = int(order[i])
        pairs = self.train[d]["pairs"]
        within = np.random.default_rng([self.seed, _stream_seed(stream), epoch, d]).permutation(pairs)
        return epoch, d, int(within[k - int(starts[i])])

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
        present = (np.arange(len(ids)) < n).astype(np.int64)
        if self.causal:  # running text: the two segments in document order
            if z["sentence_order_label"][pos]:
                b = int(z["b_start"][pos])
                ids[1:n - 1] = np.concatenate([ids[b:n - 1], [SPECIAL_TOKENS["sep"]], ids[1:b - 1]])
            return {"input_ids": ids, "labels": np.where(present > 0, ids, -100), "attention_mask": present}
        types = np.zeros_like(ids)
        types[int(z["b_start"][pos]):n] = 1
        rng = np.random.default_rng([self.seed, _stream_seed(stream), epoch + 1, d, pos])
        masked, labels = _mask(ids, rng, self.vocab_size,
                               self.n_special)
        return {"input_ids": masked, "labels": labels, "token_type_ids": types, "attention_mask": present,
                "sentence_order_label": np.int64(z["sentence_order_label"][pos])}

    def batch(self, stream: str, start: int, count: int) -> dict:
        rows = [self.sample(stream, i) for i in range(start, start + count)]
        return tensors({k: np.stack([r[k] for r in rows]) for k in rows[0]})


def read_card(bucket: Bucket, name: str, pinned: str | None = None) -> dict:
    """The data set's card; ``pinned``, the hash run.json names (``card_hash``): a card that
    does not match it (rewritten, so possibly other shards and hashes) is refused."""
    raw = bucket.read_bytes(DataLayout(name).card)
    if raw is None:
        raise DataError(f"no data set {name!r} in {bucket.url} (run the tokenize flow first)")
    if pinned is not None and card_hash(raw) != pinned:
        raise DataError(f"data set {name!r}: DATA.json does not match the hash run.json pins ({pinned[:12]}...)")
    return json.loads(raw)


def card_hash(raw: bytes) -> str:
    """What a run pins its data set by: the SHA-256 of DATA.json as stored (it lists every
    shard's hash, so it pins the samples too)."""
    return hashlib.sha256(raw).hexdigest()


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


def make_source(run):
    """The run's data: every stream of it, for training, replay and verification alike."""
    c = run.config
    causal = family(c.preset) == "causal"
    if c.data == SYNTHETIC:
        return SyntheticSource(PRESETS[c.preset]["vocab_size"], run.seq_len, c.seed, causal=causal)
    return PairSource(run.bucket, c.data, c.seed, c.data_hash, causal=causal)


def data_card(vocab_size: int, seq_len: int, seed: int) -> dict:
    """What the synthetic data set is and a few of its samples, for people reading the bucket."""
    source = SyntheticSource(vocab_size, seq_len, seed)
    preview = [source.sample("preview", i)[0][:16].tolist() for i in range(3)]
    return {"name": SYNTHETIC, "kind": "generated on the fly: a sparse Markov chain over a Zipf vocabulary",
            "vocab_size": vocab_size, "seq_len": seq_len, "seed": seed,
            "streams": "one per peer id (disjoint); '~heldout' is reserved for evaluation",
            "preview_input_ids": preview}
