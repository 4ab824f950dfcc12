"""Prepare the data workers read: train the tokenizer, pack sentence-order pairs, write shards.

The data set lands under ``data/{name}/`` in the bucket (tokenizer, shards, then DATA.json); a
run names it in its config. ``synthetic`` needs no preparation: its card is written for readers.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from dedloc_pipeline.model import corpus, packing, tokenizer
from dedloc_pipeline.model.data import SYNTHETIC, data_card
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import DataLayout


@task(cache_policy=NO_CACHE)
def load_documents(source: str, corpus_dir: str, max_documents: int | None, seed: int) -> tuple[list, dict]:
    if source == "offline":
        prov = corpus.build(corpus_dir)
        docs = corpus.offline_documents(corpus_dir)
        return docs[:max_documents] if max_documents else docs, {"shobdo.txt": prov["shobdo.txt"]}
    if source == "hub":
        docs = list(corpus.hub_documents(max_documents or 100_000, seed))
        return docs, {"hub": [{"dataset": d, "config": c, "share": p} for d, c, p in corpus.HUB_MIX]}
    raise ValueError(f"unknown text source {source!r}: offline or hub")


@task(cache_policy=NO_CACHE, retries=1)
def train_tokenizer(bucket: str, name: str, docs: list[list[str]], vocab_size: int):
    tok = tokenizer.train((s for d in docs for s in d), vocab_size)
    tokenizer.save(tok, Bucket(bucket), DataLayout(name).tokenizer)
    return tok


@task(cache_policy=NO_CACHE, retries=1)
def write_shards(bucket: str, name: str, tok, docs: list[list[str]], recipe: dict, sources: dict) -> dict:
    return packing.write_dataset(Bucket(bucket), name, tok, docs, recipe["seq_len"], recipe["seed"],
                                 sources=sources, recipe=recipe)


@flow(name="tokenize", log_prints=True)
def tokenize(bucket: str = ".dedloc/bucket", data: str = "bengali", source: str = "offline",
             vocab_size: int = 8000, seq_len: int = 128, seed: int = 0, corpus_dir: str = ".dedloc/corpus",
             max_documents: int | None = None) -> dict:
    """Make data set ``data`` from ``source`` (offline: the embedded corpus; hub: Wikipedia + OSCAR).
    A data set already made with the same settings is kept as it is."""
    b = Bucket(bucket)
    if data == SYNTHETIC:
        card = data_card(vocab_size, seq_len, seed)
        b.write_json(DataLayout(data).card, card)
        return card
    card = b.read_json(DataLayout(data).card)
    recipe = {"source": source, "vocab_size": vocab_size, "seq_len": seq_len, "seed": seed,
              "max_documents": max_documents}
    if card is not None and card.get("recipe") == recipe:
        print(f"data set {data!r} already in {bucket}: {card['splits']['train']['pairs']} training pairs")
        return card
    docs, sources = load_documents(source, corpus_dir, max_documents, seed)
    tok = train_tokenizer(bucket, data, docs, vocab_size)
    card = write_shards(bucket, data, tok, docs, recipe, sources)
    tr = card["splits"]["train"]
    print(f"data set {data!r}: tokenizer of {card['vocab_size']} tokens, {tr['pairs']} training pairs "
          f"({tr['tokens']} tokens) in {len(tr['shards'])} shards, "
          f"{card['splits']['heldout']['pairs']} held out")
    return card
