"""The offline Bengali corpus (built by `make corpus` at set-up) and a tokenizer trained on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dedloc_pipeline.model import corpus, tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built() -> Path:
    dest = ROOT / ".dedloc" / "corpus"
    corpus.build(dest)  # no-op when `make corpus` already built it
    return dest


def _bengali_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum("\u0980" <= c <= "\u09ff" for c in letters) / max(1, len(letters))


def test_corpus_is_real_bengali_with_provenance(built):
    prov = json.loads((built / "PROVENANCE.json").read_text())
    assert prov["shobdo.txt"]["license"] == "Apache-2.0" and prov["shobdo.txt"]["version"] == "0.2.2"
    assert prov["libreoffice.tsv"]["license"] == "MPL-2.0"
    lines = (built / "shobdo.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == prov["shobdo.txt"]["lines"] > 100_000
    assert len(set(lines)) == len(lines)
    assert _bengali_share("".join(lines[:5000])) > 0.95
    rows = [r.split("\t") for r in (built / "libreoffice.tsv").read_text(encoding="utf-8").splitlines()]
    labels = {m for m, _ in rows}
    assert len(rows) > 5000 and len(labels) >= 10 and {"sc", "sw"} <= labels  # Calc and Writer
    # every string has Bengali; a few also carry placeholders such as %COLUMNNUMBER
    assert sum(_bengali_share(t) > 0.5 for _, t in rows) > 0.9 * len(rows)


@pytest.mark.slow
def test_tokenizer_trained_on_the_offline_corpus_covers_held_out_text(built):
    lines = (built / "shobdo.txt").read_text(encoding="utf-8").splitlines()
    train, held_out = lines[:40_000:2], lines[1:40_000:40]
    tok = tokenizer.train(train, vocab_size=8000)
    assert len(tok) == 8000
    ids = [i for s in held_out for i in tok(s, add_special_tokens=False)["input_ids"]]
    words = sum(len(s.split()) for s in held_out)
    assert ids.count(tok.unk_token_id) / len(ids) < 0.01
    assert len(ids) / words < 3.0  # whole words or a few pieces, not characters
