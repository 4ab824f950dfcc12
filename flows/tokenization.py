"""Prepare the data workers read. Today the synthetic source (generated on the fly, so this
records its card); the Bengali corpus and tokenizer replace it behind the same data name."""

from __future__ import annotations

from prefect import flow, task

from dedloc_pipeline.data import data_card
from dedloc_pipeline.storage import Bucket


@task
def write_card(bucket: str, data: str, vocab_size: int, seq_len: int, seed: int) -> str:
    b = Bucket(bucket)
    key = f"data/{data}/DATA.json"
    b.write_json(key, data_card(data, vocab_size, seq_len, seed))
    return key


@flow(name="tokenize", log_prints=True)
def tokenize(bucket: str = ".dedloc/bucket", data: str = "synthetic", vocab_size: int = 8000,
             seq_len: int = 128, seed: int = 0) -> str:
    key = write_card(bucket, data, vocab_size, seq_len, seed)
    print(f"data {data!r} ready: {bucket}/{key}")
    return key
