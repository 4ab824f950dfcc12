"""An organizer's corpus made into a data set (dataset/): every format read, duplicates dropped,
the same bytes however the corpus is cut into files, the steps split or the run resumed, bounded
pieces, clear errors; read back by the volunteers' reader as before."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import re
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.dataset import build
from dedloc_pipeline.dataset.build import Recipe, make
from dedloc_pipeline.dataset.sources import Source, SourceError, documents, pieces
from dedloc_pipeline.model.data import PairSource
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import DataLayout

from .conftest import CORPUS

DOCS = 200  # documents of 12 lines of the embedded corpus


@pytest.fixture(scope="module")
def docs() -> list[str]:
    lines = (Path(CORPUS) / "shobdo.txt").read_text(encoding="utf-8").splitlines()[:12 * DOCS]
    return ["\n".join(lines[i:i + 12]) for i in range(0, len(lines), 12)]


def recipe(*sources: Source, **kw) -> Recipe:
    return Recipe(sources=sources, **{**dict(vocab_size=400, seq_len=48, sample_mb=0.2, partition_mb=0.1,
                                            shard_pairs=100), **kw})


def contents(bucket: Bucket, name: str) -> dict[str, str]:
    """Every object of the data set but its card, by key (less the recipe a shard's name holds):
    their hashes."""
    root = DataLayout(name).root
    return {re.sub(r"/[0-9a-f]{16}-", "/", k[len(root):]): hashlib.sha256(bucket.read_bytes(k)).hexdigest()
            for k in bucket.find(root) if not k.endswith("DATA.json")}


def write_formats(folder: Path, docs: list[str]) -> None:
    """The same documents cut into four files of four formats: gzip text, zstd JSON lines,
    Parquet, bz2 text; the text files' documents separated by blank lines."""
    folder.mkdir(parents=True, exist_ok=True)
    cut = [0, len(docs) // 8, len(docs) // 2, 3 * len(docs) // 4, len(docs)]
    with gzip.open(folder / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n\n".join(docs[cut[0]:cut[1]]) + "\n")
    rows = "".join(json.dumps({"id": i, "text": d}, ensure_ascii=False) + "\n"
                   for i, d in enumerate(docs[cut[1]:cut[2]]))
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode("utf-8")))
    pq.write_table(pa.table({"text": docs[cut[2]:cut[3]]}), folder / "c.parquet", row_group_size=16)
    (folder / "d.txt.bz2").write_bytes(bz2.compress(("\n\n".join(docs[cut[3]:cut[4]]) + "\n").encode("utf-8")))
    (folder / "README.md").write_text("not a corpus file: skipped in a folder")


def test_every_format_is_read_as_the_same_documents(tmp_path, docs):
    write_formats(tmp_path / "corpus", docs)
    srcs = [Source(url=str(tmp_path / "corpus"))]
    found = pieces(srcs)
    assert [(Path(p.url).name, p.format) for p in found] == [
        ("a.txt.gz", "text"), ("b.jsonl.zst", "jsonl"), ("c.parquet", "parquet"), ("d.txt.bz2", "text")]
    read = [d for p in found for d in documents(p, srcs[0])]
    assert read == docs


def test_the_hub_loader_reads_a_data_set_of_files_shard_by_shard(tmp_path, docs):
    """``hub:PATH`` goes through `datasets`' streaming loader, a piece per shard; PATH here is a
    folder of Parquet files the loader reads as it reads the hub's."""
    folder = tmp_path / "hub"
    folder.mkdir()
    for k in range(3):
        pq.write_table(pa.table({"text": docs[k::3]}), folder / f"train-{k}.parquet")
    src = Source(url=f"hub:{folder}")
    found = pieces([src])
    assert [(p.format, p.shard, p.shards) for p in found] == [("hub", k, 3) for k in range(3)]
    assert sorted(d for p in found for d in documents(p, src)) == sorted(docs)


@pytest.mark.slow
def test_the_same_documents_make_the_same_data_set_however_cut_split_or_run(tmp_path, docs):
    """One plain file against four files of four formats (the documents in another order,
    duplicates among them), in this process, on threads and on processes: the same shards,
    tokenizer and token counts, byte for byte; the volunteers' reader reads it."""
    (tmp_path / "one.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    shuffled = [docs[i] for i in np.random.default_rng(1).permutation(len(docs))]
    write_formats(tmp_path / "four", shuffled + shuffled[:25])  # 25 exact duplicates
    made = {}
    for tag, src, pool in (("one", tmp_path / "one.txt", None), ("four", tmp_path / "four", None),
                           ("threads", tmp_path / "four", ThreadPoolExecutor(2)),
                           ("processes", tmp_path / "four", ProcessPoolExecutor(2))):
        b = Bucket(f"file://{tmp_path}/b-{tag}")
        card = make(b, "bn", recipe(Source(url=str(src))), pool=pool)
        made[tag] = (card, contents(b, "bn"))
        if pool is not None:
            pool.shutdown()
    one, four = made["one"][0], made["four"][0]
    assert one["sources"]["summary"]["duplicates"] == 0 and four["sources"]["summary"]["duplicates"] == 25
    assert one["documents"] == four["documents"] == DOCS
    assert one["sources"]["summary"]["partitions"] > 1 and len(one["splits"]["train"]["shards"]) > 2
    assert made["one"][1] == made["four"][1] == made["threads"][1] == made["processes"][1]
    unnamed = re.compile(r"/[0-9a-f]{16}-")  # a shard's name holds its recipe: the sources differ
    assert unnamed.sub("/", json.dumps(one["splits"])) == unnamed.sub("/", json.dumps(four["splits"]))
    assert one["preview"] == four["preview"]
    held, train = one["splits"]["heldout"], one["splits"]["train"]
    assert held["pairs"] > 0 and train["pairs"] > 10 * held["pairs"] and 0.4 < train["swapped"] < 0.6
    src = PairSource(Bucket(f"file://{tmp_path}/b-four"), "bn", seed=0)
    sample = src.sample("alice", 5)
    assert sample["input_ids"].shape == (48,) and src.pairs == train["pairs"]
    assert Bucket(f"file://{tmp_path}/b-four").find(DataLayout("bn").root + "/work") == []  # records removed


def test_a_stopped_run_resumes_where_it_stopped_and_makes_the_same_bytes(tmp_path, docs, monkeypatch):
    """Killed while tokenizing its second piece, a run leaves the steps before it recorded; the
    next run does none of them again and ends with the data set an uninterrupted run makes, its
    card dated from the first start."""
    write_formats(tmp_path / "corpus", docs)
    r = recipe(Source(url=str(tmp_path / "corpus")))
    whole = Bucket(f"file://{tmp_path}/whole")
    make(whole, "bn", r)
    b = Bucket(f"file://{tmp_path}/b")
    tokenize, calls = build.tokenize, []

    def dies_at_the_second(bucket, job, i, tok, *rest):
        calls.append(i)
        if i == 1:
            raise KeyboardInterrupt  # as a Ctrl-C or a killed task
        return tokenize(bucket, job, i, tok, *rest)
    monkeypatch.setattr(build, "tokenize", dies_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        make(b, "bn", r)
    job = build.Job.model_validate_json(b.read_bytes(DataLayout("bn").job(r.id())))
    assert b.read_json(DataLayout("bn").tokenized(r.id(), 0)) is not None
    assert b.read_json(DataLayout("bn").card) is None  # no card: not a data set yet
    monkeypatch.setattr(build, "tokenize", tokenize)
    train = build.tokenizers.train
    monkeypatch.setattr(build.tokenizers, "train", lambda *a: pytest.fail("trained again"))
    card = make(b, "bn", r)
    monkeypatch.setattr(build.tokenizers, "train", train)
    assert card["created_at"] == job.started_at
    assert contents(b, "bn") == contents(whole, "bn")
    assert {k: v for k, v in card.items() if k != "created_at"} == \
        {k: v for k, v in whole.read_json(DataLayout("bn").card).items() if k != "created_at"}
    assert make(b, "bn", r)["created_at"] == card["created_at"]  # made: kept as it is


def test_a_piece_is_held_a_chunk_at_a_time(tmp_path, docs, monkeypatch):
    """What a piece holds before its pairs go to the parts is bounded (``FLUSH_PAIRS``): with a
    bound of 64 pairs a piece writes many chunks, and the data set is the same."""
    (tmp_path / "one.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    r = recipe(Source(url=str(tmp_path / "one.txt")))
    loose = Bucket(f"file://{tmp_path}/loose")
    make(loose, "bn", r)
    monkeypatch.setattr(build, "FLUSH_PAIRS", 64)
    tight = Bucket(f"file://{tmp_path}/tight")
    job = build.start(tight, "bn", r)
    build.survey(tight, job, 0)
    build.decide(tight, job)
    build.sample(tight, job, 0)
    tok = build.train(tight, job)
    assert build.tokenize(tight, job, 0, tok)["chunks"] > 10
    make(tight, "bn", r)
    assert contents(tight, "bn") == contents(loose, "bn")


def test_max_documents_and_the_seed_choose_by_text_alone(tmp_path, docs):
    (tmp_path / "one.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    src = Source(url=str(tmp_path / "one.txt"))
    few = make(Bucket(f"file://{tmp_path}/few"), "bn", recipe(src, max_documents=50))
    assert few["documents"] == 50 and few["sources"]["summary"]["documents_read"] == DOCS
    other = make(Bucket(f"file://{tmp_path}/other"), "bn", recipe(src, seed=1))
    same = make(Bucket(f"file://{tmp_path}/same"), "bn", recipe(src))
    assert other["splits"]["train"]["shards"] != same["splits"]["train"]["shards"]


def test_bad_sources_are_refused_in_one_line(tmp_path, docs):
    b = Bucket(f"file://{tmp_path}/b")
    (tmp_path / "rows.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "ক"}\n{"text": \n')
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / "one.txt").write_text("ক।\n\nক।\n")
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "missing.txt", "not found"), (tmp_path / "notes.md", "not a text format"),
             (tmp_path / "empty", "no text files there"), (tmp_path / "rows.jsonl", "without the field 'text'"),
             (tmp_path / "broken.jsonl", "line 2: not JSON"), (tmp_path / "one.txt", "1 distinct documents")]
    for path, said in cases:
        with pytest.raises(SourceError, match=said):
            make(b, "bad", recipe(Source(url=str(path))))
    (tmp_path / "grows.txt").write_text("\n\n".join(docs[:50]) + "\n")
    r = recipe(Source(url=str(tmp_path / "grows.txt")))
    build.start(b, "g", r)
    (tmp_path / "grows.txt").write_text("\n\n".join(docs[:60]) + "\n")
    with pytest.raises(SourceError, match="sources changed since"):
        make(b, "g", r)


def test_the_command_line_makes_it_with_its_licence(tmp_path, docs):
    write_formats(tmp_path / "corpus", docs)
    url = f"file://{tmp_path}/bucket"
    res = CliRunner().invoke(app, ["data", "make", str(tmp_path / "corpus"), "--bucket", url, "--name", "bn",
                                   "--licence", "CC BY-SA 4.0", "--vocab-size", "400", "--seq-len", "48",
                                   "--sample-mb", "0.2", "--jobs", "2"])
    assert res.exit_code == 0, res.output
    card = Bucket(url).read_json(DataLayout("bn").card)
    pairs = card["splits"]["train"]["pairs"]
    assert f"{DOCS} documents (0 duplicates dropped)" in res.output and f"{pairs:,} training pairs" in res.output
    [src] = card["sources"]["sources"]
    assert src["licence"] == "CC BY-SA 4.0" and src["pieces"] == 4 and src["bytes"] > 0
    bad = CliRunner().invoke(app, ["data", "make", str(tmp_path / "nowhere"), "--bucket", url])
    assert bad.exit_code == 2 and bad.output.strip().startswith("error: source") and "not found" in bad.output


def test_a_data_set_made_before_partitions_reads_as_it_did(tmp_path, docs):
    """Data sets made before (shards ``{split}/{i:05d}.npz``, as the card lists them) are read by
    key and hash from their card: the volunteers' reading is unchanged."""
    (tmp_path / "one.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    b = Bucket(f"file://{tmp_path}/b")
    card = make(b, "new", recipe(Source(url=str(tmp_path / "one.txt"))))
    old = json.loads(json.dumps(card))
    for split, meta in old["splits"].items():
        for i, shard in enumerate(meta["shards"]):
            made = card["splits"][split]["shards"][i]["key"]
            shard["key"] = f"data/old/{split}/{i:05d}.npz"
            b.write_bytes(shard["key"], b.read_bytes(made))
    b.write_bytes("data/old/unigram.npz", b.read_bytes("data/new/unigram.npz"))
    old["unigram"]["key"] = "data/old/unigram.npz"
    b.write_json("data/old/DATA.json", {**old, "name": "old"})
    new_src, old_src = PairSource(b, "new", seed=3), PairSource(b, "old", seed=3)
    for i in (0, 7, 999):
        a, c = new_src.sample("bob", i), old_src.sample("bob", i)
        assert all(np.array_equal(a[k], c[k]) for k in a)


def test_a_step_never_builds_on_other_bytes_than_it_makes(tmp_path, docs):
    """A resumed step rewrites what it had written (the same bytes pass); an object at its key
    with other bytes (another writer, a source changed under it) stops the run, in one line."""
    (tmp_path / "one.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    r = recipe(Source(url=str(tmp_path / "one.txt")))
    b = Bucket(f"file://{tmp_path}/b")
    job = build.start(b, "bn", r)
    build.survey(b, job, 0)
    summary = build.decide(b, job)
    build.sample(b, job, 0)
    tok = build.train(b, job)
    keys = DataLayout("bn")
    for p in range(summary["partitions"]):
        b.write_bytes(keys.part(r.id(), p, 0, 0), b"someone else's")
    with pytest.raises(SourceError, match="other bytes than this run makes"):
        build.tokenize(b, job, 0, tok)
