"""Shared fixtures: small runs on real buckets (a local folder, and moto's S3 server on loopback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from dedloc_pipeline.protocol.config import CloseRule, OptimizerConfig, RunConfig
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket

# Small enough to be quick on 2 cores, big enough to cut the ~1.9M-parameter vector into
# several chunks and several aggregator parts (one part straddles tensors).
SMALL = dict(seq_len=32, chunk_size=1 << 18, block_size=4096, chunks_per_part=3)


def small_config(run: str = "test", **kw) -> RunConfig:
    opt = kw.pop("optimizer", {})
    close = kw.pop("close", {})
    base = dict(SMALL, run=run, target_batch_size=24, micro_batch=4, codec="none",
                delayed_updates=False, peer_timeout_s=30.0)
    base.update(kw)
    return RunConfig(**base, optimizer=OptimizerConfig(**opt), close=CloseRule(**close))


@pytest.fixture
def bucket(tmp_path) -> Bucket:
    return Bucket(f"file://{tmp_path}/bucket")


@pytest.fixture
def make_run(bucket):
    def make(**kw):
        return init_run(bucket, small_config(**kw))
    return make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server on loopback, as s3fs's own tests use."""
    port = _free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("moto server did not start")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> Bucket:
    """A fresh S3 bucket on the loopback server; credentials through the usual AWS variables."""
    for k, v in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                     AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s3_endpoint).items():
        monkeypatch.setenv(k, v)
    name = f"dedloc-{uuid.uuid4().hex[:10]}"
    Bucket(f"s3://{name}").fs.mkdir(name)
    return Bucket(f"s3://{name}/collab")


CORPUS = os.path.join(os.path.dirname(__file__), os.pardir, ".dedloc", "corpus")


@pytest.fixture(scope="session")
def bengali(tmp_path_factory):
    """A small tokenized data set from the offline Bengali corpus (`make corpus`): 400 documents,
    a 2000-token tokenizer, sequences of 32, shards of 64 pairs. Returns (bucket URL, name)."""
    from dedloc_pipeline.model import corpus, packing, tokenizer
    docs = corpus.offline_documents(CORPUS)[:400]
    tok = tokenizer.train((s for d in docs for s in d), 2000)
    url = f"file://{tmp_path_factory.mktemp('data')}/bucket"
    tokenizer.save(tok, Bucket(url), "data/bn-test/tokenizer")
    packing.write_dataset(Bucket(url), "bn-test", tok, docs, seq_len=SMALL["seq_len"], seed=0, shard_pairs=64)
    return url, "bn-test"
