"""sahajBERT's normalization, Unigram training, and the round trip through the bucket."""

import json
from pathlib import Path

import pytest

from dedloc_pipeline.model import tokenizer
from dedloc_pipeline.model.presets import SPECIAL_TOKENS

from .conftest import CORPUS


@pytest.mark.parametrize("raw,normal", [
    ("আমি  বাংলায়    গান গাই", "আমি বাংলায় গান গাই"),       # repeated spaces collapse
    ("সে বাড়ি গেল৤", "সে বাড়ি গেল।"),                       # ৤ -> ।
    ("সে বাড়ি গেল|", "সে বাড়ি গেল।"),                       # | -> ।
    ("সে বাড়ি গেল৷", "সে বাড়ি গেল।"),                       # ৷ -> ।
    ("শেষ৥", "শেষ॥"),                                       # ৥ -> ॥
    ("দু:খ", "দুঃখ"),                                        # colon after a Bengali letter -> visarga
    ("time: 10:30", "time: 10:30"),                          # other colons stay
    ("ＡＢＣ Dhaka", "abc dhaka"),                            # NFKC, then lowercase
    ("ক\u0007খ", "কখ"),                                      # NMT drops control characters ...
    ("ক\u200bখ", "ক খ"),                                     # ... and maps odd spaces to a space
])
def test_sahajbert_normalization(raw, normal):
    assert tokenizer.normalizer().normalize_str(raw) == normal


# A few lines of Bengali written for this test: enough to exercise training, not a corpus.
TEXT = [
    "আমি বাংলায় গান গাই। আমি বাংলার গান গাই।",
    "ঢাকা বাংলাদেশের রাজধানী। কলকাতা পশ্চিমবঙ্গের রাজধানী।",
    "২০২১ সালে ৪০ জন স্বেচ্ছাসেবক একসাথে একটি ভাষা মডেল প্রশিক্ষণ দিয়েছিলেন।",
    "দুঃখ আর সুখ মিলিয়েই জীবন৤ সে বাড়ি গেল|",
] * 20


def test_trained_tokenizer_encodes_pairs_and_round_trips(bucket):
    tok = tokenizer.train(TEXT, vocab_size=200)
    assert [tok.convert_tokens_to_ids(t) for t in tokenizer.SPECIALS] == [
        SPECIAL_TOKENS[k] for k in ("pad", "unk", "cls", "sep", "mask")]
    assert len(tok) <= 200
    enc = tok("ঢাকা রাজধানী", "২০২১ সালে", return_token_type_ids=True)
    ids = enc["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and ids.count(tok.sep_token_id) == 2
    assert set(enc["token_type_ids"]) == {0, 1}
    pieces = tok.convert_ids_to_tokens(ids)
    assert {"২", "০", "১"} <= set(pieces)   # digits split one by one
    assert "।" in tok.convert_ids_to_tokens(tok("গেল।")["input_ids"])  # punctuation isolated
    assert tok.decode(tok("দু:খ আর সুখ", add_special_tokens=False)["input_ids"]) == "দুঃখ আর সুখ"
    keys = tokenizer.save(tok, bucket, "tokenizer/test")
    assert "tokenizer/test/tokenizer.json" in keys
    again = tokenizer.load(bucket, "tokenizer/test")
    assert again("ঢাকা রাজধানী", "২০২১ সালে")["input_ids"] == ids
    with pytest.raises(FileNotFoundError):
        tokenizer.load(bucket, "tokenizer/none")


def test_the_same_text_trains_the_same_tokenizer_byte_for_byte():
    """The trainer visits its counts in a hash map's order, new each time: the same pieces came
    out with other ids (ties, and the last characters' scores dealt in another order). The trained
    vocabulary is made canonical, so a data set's ids depend on its text alone."""
    lines = (Path(CORPUS) / "shobdo.txt").read_text(encoding="utf-8").splitlines()[:3000]
    made = {tokenizer.train(iter(lines), 600).backend_tokenizer.to_str() for _ in range(3)}
    assert len(made) == 1
    vocab = json.loads(made.pop())["model"]["vocab"]
    assert [p for p, _ in vocab[:len(tokenizer.SPECIALS)]] == tokenizer.SPECIALS
    rest = vocab[len(tokenizer.SPECIALS):]
    assert rest == sorted(rest, key=lambda x: (-x[1], x[0])) and all(s == round(s, 4) for _, s in rest)
