"""The organizer's data set: ``dedloc data make``, the tokenize flow's steps without Prefect."""

from __future__ import annotations

from typing import Optional

import typer

from .common import EndpointOpt, app, setup

data_app = typer.Typer(no_args_is_help=True, help="Make the tokenized data set a run trains on.")
app.add_typer(data_app, name="data")


@data_app.command()
def make(sources: list[str] = typer.Argument(..., metavar="SOURCE...",
                                            help="files, folders or globs (fsspec URLs: a path, s3://...) of .txt, "
                                                 ".jsonl or .parquet, optionally .gz/.zst/.bz2/.xz; or "
                                                 "hub:PATH[:CONFIG], a data set the `datasets` library streams"),
         bucket: str = typer.Option(..., "--bucket", help="where the data set goes: data/NAME/ in this bucket"),
         name: str = typer.Option("bengali", "--name", help="the data set's name (a run's --data)"),
         licence: list[str] = typer.Option([], "--licence", help="each source's licence, recorded in DATA.json "
                                                                 "(once for all, or once per source)"),
         text_field: str = typer.Option("text", help="JSON lines and Parquet: the field of a document's text"),
         lines_per_document: Optional[int] = typer.Option(
             None, min=1, help="plain text without blank lines between documents: runs of this many lines"),
         vocab_size: int = typer.Option(8000, min=16), seq_len: int = typer.Option(128, min=8),
         seed: int = 0, heldout_fraction: float = typer.Option(0.02, min=0.0, max=0.5),
         max_documents: Optional[int] = typer.Option(None, min=2, help="only the first N documents of the "
                                                                       "canonical order (a trial's data set)"),
         sample_mb: float = typer.Option(64.0, min=0.001, help="MB of text the tokenizer is trained on, at most"),
         partition_mb: float = typer.Option(64.0, min=0.001, help="MB of text per partition (what one step holds)"),
         jobs: int = typer.Option(1, min=1, help="processes making pieces and partitions at once"),
         endpoint_url: Optional[str] = EndpointOpt, verbose: bool = False):
    """Make a data set from a corpus: documents deduplicated, a tokenizer trained on a seeded
    sample, sentence-order pairs in shards, DATA.json last. Stopped, it resumes where it stopped."""
    setup(verbose)
    from concurrent.futures import ProcessPoolExecutor
    from contextlib import nullcontext

    from rich.progress import Progress

    from ..dataset.build import Recipe, make as make_data_set
    from ..dataset.sources import Source
    from ..storage.bucket import Bucket

    if len(licence) not in (0, 1, len(sources)):
        raise typer.BadParameter(f"{len(licence)} licences for {len(sources)} sources: give one, or one per source",
                                 param_hint="--licence")
    licences = licence * len(sources) if len(licence) == 1 else licence or [None] * len(sources)
    recipe = Recipe(sources=tuple(Source(url=u, licence=lic, text_field=text_field,
                                         lines_per_document=lines_per_document) for u, lic in zip(sources, licences)),
                    vocab_size=vocab_size, seq_len=seq_len, seed=seed, heldout_fraction=heldout_fraction,
                    max_documents=max_documents, sample_mb=sample_mb, partition_mb=partition_mb)
    with Progress(transient=True) as bar, (ProcessPoolExecutor(jobs) if jobs > 1 else nullcontext()) as pool:
        steps: dict[str, int] = {}

        def progress(step: str, done: int, total: int) -> None:
            if step not in steps:
                steps[step] = bar.add_task(step, total=total)
            bar.update(steps[step], completed=done)

        card = make_data_set(Bucket(bucket, endpoint_url=endpoint_url), name, recipe, pool, progress)
    made, tr = card["sources"]["summary"], card["splits"]["train"]
    typer.echo(f"data set {name} in {bucket}: {made['documents']:,} documents ({made['duplicates']:,} duplicates "
               f"dropped), a {card['vocab_size']:,}-token tokenizer, {tr['pairs']:,} training pairs in "
               f"{len(tr['shards'])} shards, {card['splits']['heldout']['pairs']:,} held out")
