"""Sentence-order pairs, data shards in the bucket, and the streams peers train on."""

from __future__ import annotations

import numpy as np
import pytest

from dedloc_pipeline.model.data import HELDOUT, DataError, PairSource, read_card
from dedloc_pipeline.model.packing import CLS, SEP, pack, sop_pairs
from dedloc_pipeline.model.presets import PRESETS
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket

from .conftest import TINY, small_config


def test_sop_pairs_are_consecutive_text_in_or_out_of_order():
    doc = [list(range(100 * i, 100 * i + n)) for i, n in enumerate([5, 9, 3, 12, 7, 4, 30, 2])]
    text = sum(doc, [])
    rng = np.random.default_rng(0)
    labels = []
    for _ in range(50):
        for a, b, y in sop_pairs(doc, 20, rng):
            assert a and b and len(a) + len(b) <= 20
            first, second = (a, b) if y == 0 else (b, a)
            joined = first + second
            start = text.index(joined[0])
            assert text[start:start + len(joined)] == joined  # contiguous, in document order
            labels.append(y)
    assert 0.35 < np.mean(labels) < 0.65


def test_pack_marks_segments():
    arrays = pack([([7, 8], [9, 10, 11], 1)], seq_len=10)
    assert arrays["input_ids"][0].tolist() == [CLS, 7, 8, SEP, 9, 10, 11, SEP, 0, 0]
    assert (arrays["b_start"][0], arrays["length"][0], arrays["sentence_order_label"][0]) == (4, 8, 1)


def _all_pairs(source: PairSource) -> int:
    return sum(s["pairs"] for s in source.train)


def test_a_stream_is_its_own_deterministic_order_that_nobody_can_steer(bengali):
    """Each stream visits every pair once per epoch, in an order only (seed, stream) decides:
    nothing in the bucket changes it (the claim markers this replaced could be created in bulk
    and overwritten), and anyone replays it from nothing but the data set."""
    url, name = bengali
    run = init_run(Bucket(url), small_config("shares", data=name))
    a = PairSource(run.bucket, name, 0)
    total = _all_pairs(a)
    epoch0 = [a.locate("a", i) for i in range(total)]
    assert {e for e, _, _ in epoch0} == {0}
    pairs = {(d, p) for _, d, p in epoch0}
    assert len(pairs) == total == sum(s["pairs"] for s in a.train), "an epoch is every pair once"
    assert [d for _, d, _ in epoch0[:3]] == [epoch0[0][1]] * 3, "a stream reads one shard at a time"
    epoch1 = [a.locate("a", total + i)[1:] for i in range(total)]
    assert set(epoch1) == pairs and epoch1 != [x[1:] for x in epoch0], "every epoch reshuffles"
    b_order = [a.locate("b", i)[1:] for i in range(total)]
    assert b_order != [x[1:] for x in epoch0], "streams are independent orders"
    # debris and forged markers in the run change nothing; a fresh reader replays every stream
    for key in ("runs/shares/claims/00000000.json", "runs/shares/claims/00000001.json"):
        run.bucket.write_json(key, {"peer": "a"})
    replay = PairSource(Bucket(url), name, 0)
    assert [replay.locate("a", i) for i in range(total)] == epoch0
    for k in (0, 5, total - 1, 10 * total + 3):
        ra, rb = replay.batch("a", k, 1), a.batch("a", k, 1)
        assert all(np.array_equal(ra[key], rb[key]) for key in ra)
    reseeded = PairSource(Bucket(url), name, 1)
    assert [reseeded.locate("a", i) for i in range(8)] != epoch0[:8], "the seed decides too"
    with pytest.raises(DataError, match="no sample -1"):
        a.locate("a", -1)


def test_samples_are_masked_pairs_and_heldout_is_apart(bengali):
    url, name = bengali
    run = init_run(Bucket(url), small_config("masks", data=name))
    src = PairSource(run.bucket, name, 0)
    batch = src.batch("p", 0, 16)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == (16, 32) and set(batch) >= {"token_type_ids", "sentence_order_label", "attention_mask"}
    assert (ids[:, 0] == CLS).all() and ((labels != -100).sum(1) >= 1).all()
    assert ((labels == -100) | (labels >= 5)).all()  # specials and padding are never targets
    assert (batch["token_type_ids"] * (1 - batch["attention_mask"])).sum() == 0
    card = read_card(run.bucket, name)
    assert card["splits"]["heldout"]["pairs"] > 0 and 0.35 < card["splits"]["train"]["swapped"] < 0.65
    assert 3.0 < card["unigram_entropy"] < np.log(card["vocab_size"])
    held = src.batch(HELDOUT, 0, 4)
    assert held["input_ids"].shape == (4, 32)


def test_bad_data_is_a_clear_error(bengali, tmp_path):
    url, name = bengali
    b = Bucket(url)
    with pytest.raises(DataError, match="sequence length 32"):
        init_run(b, small_config("long", data=name, seq_len=64))
    with pytest.raises(DataError, match="no data set 'nope'"):
        init_run(b, small_config("none", data="nope"))
    assert not b.exists("runs/long/run.json") and not b.exists("runs/none/run.json")
    # a shard whose bytes changed is refused, not trained on
    copy = Bucket(f"file://{tmp_path}/copy")
    for key in b.find(f"data/{name}"):
        copy.write_bytes(key, b.read_bytes(key))
    shard0 = read_card(copy, name)["splits"]["train"]["shards"][0]["key"]
    raw = bytearray(copy.read_bytes(shard0))
    raw[len(raw) // 2] ^= 0xFF
    copy.write_bytes(shard0, bytes(raw))
    src = PairSource(copy, name, 0)
    with pytest.raises(DataError, match="does not match its hash"):
        for k in range(_all_pairs(src)):
            src.sample("p", k)


@pytest.mark.slow
def test_collaborative_pretraining_on_bengali_lowers_heldout_loss(bengali):
    from dedloc_pipeline.evaluation.heldout import heldout_scores
    from dedloc_pipeline.testing import collaborate

    url, name = bengali
    # tiny, as the first run trains it: micro learns too, but by less than the bound below
    run = init_run(Bucket(url), small_config("learn", **TINY, data=name, codec="int8", optimizer={"lr": 3e-3}))
    collaborate(run, [("a", 4), ("b", 3)], rounds=6)
    before, sop0 = heldout_scores(run, run.load_params(0), 64)
    after, sop6 = heldout_scores(run, run.load_params(6), 64)
    assert after < before - 1.0, (before, after)
    assert sop0 is not None and sop6 is not None  # sentence order is trained and scored too
    closes = [run.bucket.read_json(run.keys.close(r)) for r in range(6)]
    used = {(s["peer"], i) for c in closes for s in c["accepted"] for a, n in s["data"]["ranges"]
            for i in range(a, a + n)}
    src = PairSource(run.bucket, name, 0)
    located = {p: [src.locate(p, i) for q, i in used if q == p] for p in ("a", "b")}
    assert all(len(set(v)) == len(v) for v in located.values())  # no peer trained on a pair twice


def test_unigram_bias_starts_the_run_at_the_unigram_loss(bengali, tmp_path):
    from dedloc_pipeline.evaluation.export import model_at
    from dedloc_pipeline.evaluation.heldout import heldout_scores
    from dedloc_pipeline.model.data import unigram_log_probs

    url, name = bengali
    plain = init_run(Bucket(url), small_config("zeros", data=name))
    biased = init_run(Bucket(url), small_config("unigram", data=name, unigram_bias=True))
    logp = unigram_log_probs(biased.bucket, name, PRESETS[biased.config.preset]["vocab_size"])
    assert np.allclose(model_at(biased, 0).predictions.bias.detach().numpy(), logp)
    assert np.exp(logp).sum() == pytest.approx(1.0, abs=1e-4)
    loss0, _ = heldout_scores(plain, plain.load_params(0), 32)
    loss_u, _ = heldout_scores(biased, biased.load_params(0), 32)
    assert loss_u < loss0 - 1.0  # no need to learn token frequencies first
    # the encoder is untouched: only the output bias differs
    diff = np.flatnonzero(plain.load_params(0) != biased.load_params(0))
    t = next(t for t in biased.flat.tensors if t.name == "predictions.bias")
    assert diff.min() >= t.offset and diff.max() < t.offset + t.size
    broken = Bucket(f"file://{tmp_path}/copy")
    for key in Bucket(url).find(f"data/{name}"):
        if not key.endswith("unigram.npz"):
            broken.write_bytes(key, Bucket(url).read_bytes(key))
    with pytest.raises(DataError, match="no intact unigram counts"):
        init_run(broken, small_config("u2", data=name, unigram_bias=True))
