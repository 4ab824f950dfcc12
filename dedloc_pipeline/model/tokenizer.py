"""The sahajBERT tokenizer: its normalization, Unigram training, and a home in the bucket.

Normalization follows sahajBERT: NMT and NFKC, repeated spaces collapsed, the Bengali danda
variants (৤, |, ৷ → ।; ৥ → ॥), a colon right after a Bengali letter read as visarga (ঃ), lowercase.
Pre-tokenization marks whitespace (▁), splits digits one by one and isolates punctuation.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ..storage.bucket import Bucket

# Same ids as model.SPECIAL_TOKENS: pad 0, unk 1, cls 2, sep 3, mask 4.
SPECIALS = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
BENGALI_LETTER = "[\u0980-\u09FF]"
SCORE_DECIMALS = 4


def normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.Nmt(), normalizers.NFKC(),
        normalizers.Replace(Regex(" {2,}"), " "),
        normalizers.Replace("৤", "।"), normalizers.Replace("|", "।"), normalizers.Replace("৷", "।"),
        normalizers.Replace("৥", "॥"),
        normalizers.Replace(Regex(f"(?<={BENGALI_LETTER}):"), "ঃ"),
        normalizers.Lowercase(),
    ])


def _backend() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(prepend_scheme="always"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(),
    ])
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    return tok


def train(texts: Iterable[str], vocab_size: int = 32000) -> PreTrainedTokenizerFast:
    """A Unigram model over ``texts``; ``vocab_size`` counts the special tokens."""
    tok = _backend()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok = _canonical(tok)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return _wrap(tok)


def _canonical(tok: Tokenizer) -> Tokenizer:
    """The trained model with its pieces' scores rounded (to ``SCORE_DECIMALS``) and ordered by
    score, then by the piece itself, after the special tokens. The trainer visits its counts in a
    hash map's order, which changes between processes: the same text gives the same pieces, with
    scores that differ in their last bits, ties in another order and its last characters' scores
    dealt in another order, so other ids. Canonical, the same text gives the same tokenizer, byte
    for byte (a log-probability to 1e-4 leaves every segmentation as it was but near-exact ties)."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    specials = vocab[:len(SPECIALS)]
    rest = sorted(([p, round(score, SCORE_DECIMALS)] for p, score in vocab[len(SPECIALS):]),
                  key=lambda x: (-x[1], x[0]))
    # the characters it must keep come last, each 1e-4 under the one before down to a floor, in
    # that hash order: the same scores, given to the characters in their own order
    k = len(rest) - 1
    while k > 0 and rest[k - 1][1] - rest[k][1] < 1e-4 + 1e-6:
        k -= 1
    if k < len(rest) - 1:
        rest[k:] = [[p, score] for p, (_, score) in zip(sorted(p for p, _ in rest[k:]), rest[k:])]
    spec["model"]["vocab"] = specials + rest
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def for_generation(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The same tokenizer for a causal decoder's prompts: ``[CLS]`` starts a text and nothing
    ends it (``[SEP]``, which ends a segment, is the model's to generate: its eos)."""
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A [SEP] $B:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    out = _wrap(backend)
    out.bos_token, out.eos_token = "[CLS]", "[SEP]"
    return out


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def save(tok: PreTrainedTokenizerFast, bucket: Bucket, key: str) -> list[str]:
    """Write the tokenizer's files (``save_pretrained``) under ``key``; the list of keys."""
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        keys = []
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                bucket.write_bytes(f"{key}/{name}", f.read())
            keys.append(f"{key}/{name}")
    return keys


def load(bucket: Bucket, key: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved under ``key``, as a transformers fast tokenizer."""
    names = bucket.list(key)
    if "tokenizer.json" not in names:
        raise FileNotFoundError(f"no tokenizer at {bucket.url}/{key}")
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            with open(os.path.join(d, name), "wb") as f:
                f.write(bucket.read_bytes(f"{key}/{name}"))
        return PreTrainedTokenizerFast.from_pretrained(d)
