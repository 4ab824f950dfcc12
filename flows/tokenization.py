"""Make the data set workers read: an organizer's corpus through dataset/build.py's steps, each
piece's and partition's a mapped task on the runner chosen (threads, processes, Dask).

The data set lands under ``data/{name}/`` in the bucket (tokenizer, shards, then DATA.json); a
run names it in its config. Without sources it is made from the embedded corpus (`make corpus`).
``synthetic`` needs no preparation: its card is written for readers.
"""

from __future__ import annotations

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from dedloc_pipeline.dataset import build
from dedloc_pipeline.dataset.build import Job, Recipe
from dedloc_pipeline.dataset.sources import Source, embedded
from dedloc_pipeline.model.data import SYNTHETIC, data_card
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import DataLayout
from flows.common import dask_address, task_runner

step = task(cache_policy=NO_CACHE, retries=1)


@step
def survey(bucket: str, job: Job, i: int) -> int:
    return build.survey(Bucket(bucket), job, i)


@step
def decide(bucket: str, job: Job) -> dict:
    return build.decide(Bucket(bucket), job)


@step
def sample(bucket: str, job: Job, i: int) -> int:
    return build.sample(Bucket(bucket), job, i)


@step
def train(bucket: str, job: Job):
    return build.train(Bucket(bucket), job)


@step
def tokenize_piece(bucket: str, job: Job, i: int, tok) -> dict:
    return build.tokenize(Bucket(bucket), job, i, tok)


@step
def pack(bucket: str, job: Job, p: int, vocab: int) -> dict:
    return build.pack(Bucket(bucket), job, p, vocab)


@step
def finish(bucket: str, job: Job, tok, summary: dict) -> dict:
    return build.finish(Bucket(bucket), job, tok, summary)


@flow(name="make-data-set")
def make_data_set(bucket: str, data: str, recipe: Recipe) -> dict:
    """The steps in order; each piece's and partition's mapped."""
    job = build.start(Bucket(bucket), data, recipe)
    pieces = range(len(job.pieces))
    surveyed = survey.map(unmapped(bucket), unmapped(job), pieces)
    summary = decide.submit(bucket, job, wait_for=surveyed).result()
    sampled = sample.map(unmapped(bucket), unmapped(job), pieces)
    tok = train.submit(bucket, job, wait_for=sampled).result()
    tokenized = tokenize_piece.map(unmapped(bucket), unmapped(job), pieces, unmapped(tok))
    packed = pack.map(unmapped(bucket), unmapped(job), range(summary["partitions"]), unmapped(len(tok)),
                      wait_for=tokenized)
    return finish.submit(bucket, job, tok, summary, wait_for=packed).result()


@flow(name="tokenize", log_prints=True)
def tokenize(bucket: str = ".dedloc/bucket", data: str = "bengali", sources: list[str | dict] | None = None,
             vocab_size: int = 8000, seq_len: int = 128, seed: int = 0, corpus_dir: str = ".dedloc/corpus",
             max_documents: int | None = None, sample_mb: float = 64.0, runner: str = "threads",
             parallel: int = 2, dask_scheduler: str | None = None) -> dict:
    """Make data set ``data`` from ``sources`` (URLs, or dicts of a source's fields: licence,
    text_field, lines_per_document; none: the embedded corpus) on ``runner``. A data set already
    made with the same recipe is kept as it is; a run stopped part way resumes where it stopped."""
    b = Bucket(bucket)
    if data == SYNTHETIC:
        card = data_card(vocab_size, seq_len, seed)
        b.write_json(DataLayout(data).card, card)
        return card
    chosen = [Source(url=s) if isinstance(s, str) else Source(**s) for s in sources] if sources else \
        [embedded(corpus_dir)]
    recipe = Recipe(sources=tuple(chosen), vocab_size=vocab_size, seq_len=seq_len, seed=seed,
                    max_documents=max_documents, sample_mb=sample_mb)
    card = b.read_json(DataLayout(data).card)
    if card is not None and card.get("recipe") == recipe.model_dump(mode="json"):
        print(f"data set {data!r} already in {bucket}: {card['splits']['train']['pairs']} training pairs")
        return card
    with dask_address(runner, parallel, dask_scheduler) as address:
        card = make_data_set.with_options(task_runner=task_runner(runner, parallel, address))(bucket, data, recipe)
    tr, made = card["splits"]["train"], card["sources"]["summary"]
    print(f"data set {data!r}: {made['documents']} documents ({made['duplicates']} duplicates dropped), a tokenizer "
          f"of {card['vocab_size']} tokens, {tr['pairs']} training pairs ({tr['tokens']} tokens) in "
          f"{len(tr['shards'])} shards, {card['splits']['heldout']['pairs']} held out")
    return card
