"""Commands that read a run and say how it goes (status, plots, the report page), score it (eval,
export), or price one (cost)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ..model.presets import PRESETS
from ..protocol.config import recipe_config
from .common import BucketOpt, EndpointOpt, RunOpt, app, open_run, setup


@app.command()
def status(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           as_json: bool = typer.Option(False, "--json", help="one JSON object")):
    """Where a run stands: the open round and its ETA, the last rounds, the contributors."""
    setup(False)
    from ..monitoring.status import show, status as get_status
    s = get_status(open_run(bucket, run, endpoint_url))
    if as_json:
        typer.echo(json.dumps(s))
        return
    from rich.console import Console
    show(s, Console())


@app.command()
def plot(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
         out: str = typer.Option(..., help="folder for the PNG figures")):
    """Draw the ledger as PNGs: loss, samples/s and contributors per round."""
    setup(False)
    from ..monitoring.plots import write
    from ..monitoring.status import status as get_status
    paths = write(get_status(open_run(bucket, run, endpoint_url))["history"], out)
    typer.echo("\n".join(paths))


@app.command()
def report(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           out: str = typer.Option(..., help="the HTML file to write"),
           upload: bool = typer.Option(False, help="also put it in the bucket (runs/RUN/report/index.html)")):
    """Write one self-contained HTML page of the run (figures, leaderboard, rounds, evaluations)."""
    setup(False)
    from ..monitoring.report import publish, render
    r = open_run(bucket, run, endpoint_url)
    page = render(r)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    typer.echo(f"report written to {out}")
    if upload:
        typer.echo(f"uploaded to {publish(r, page)}")


@app.command("eval")
def eval_(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
          state: Optional[int] = typer.Option(None, help="committed state (default: the latest)"),
          task: Optional[list[str]] = typer.Option(
              None, help="mlm-heldout | lm-heldout | ner | news (default: the run's held-out loss, and ner and "
              "news for an ALBERT trained on text)"),
          source: str = typer.Option("offline", help="offline (the project's stand-in sets) | hub (WikiANN-bn, Soham)"),
          corpus_dir: str = typer.Option(".dedloc/corpus", help="the offline corpus (`make corpus`)"),
          epochs: int = typer.Option(20, help="most fine-tuning epochs (early stopping ends sooner)"),
          max_train: Optional[int] = typer.Option(None, help="fine-tune on at most N training examples"),
          verbose: bool = False):
    """Score a committed state next to random init: held-out loss, NER F1, news accuracy."""
    setup(verbose)
    from ..evaluation import heldout as evaluation
    r = open_run(bucket, run, endpoint_url)
    state = r.latest() if state is None else state
    for name in task or evaluation.default_tasks(r):
        if name.endswith("heldout"):
            res = evaluation.evaluate(r, state)
            typer.echo(f"{res['task']} ({res['dataset']}): loss {res['loss']:.4f}, perplexity "
                       f"{res['perplexity']:.1f} (random init {res['random_init_loss']:.4f})")
        else:
            res = evaluation.finetune_eval(r, state, name, source, corpus_dir, epochs=epochs,
                                           max_train=max_train)
            typer.echo(f"{name} ({res['source']}): test {res['metric']} {res['pretrained']['test']:.4f} "
                       f"(random init {res['random_init']['test']:.4f})")


@app.command()
def export(bucket: str = BucketOpt, run: str = RunOpt, endpoint_url: Optional[str] = EndpointOpt,
           out: str = typer.Option(..., help="folder for the Hugging Face model and tokenizer"),
           state: Optional[int] = typer.Option(None, help="committed state (default: the latest)")):
    """Write a committed state as a Hugging Face directory (AutoModelForMaskedLM.from_pretrained)."""
    setup(False)
    from ..evaluation.export import export as export_state
    path = export_state(open_run(bucket, run, endpoint_url), state, out)
    typer.echo(f"exported to {path}")


@app.command("cost")
def cost_(peers: int = typer.Option(..., help="volunteers training at once"),
          days: float = typer.Option(..., help="length of the run"),
          preset: Optional[str] = typer.Option(None, help=f"{' | '.join(PRESETS)} (default tiny; not with --bucket)"),
          samples_per_s: Optional[float] = typer.Option(
              None, "--samples-per-s", help="one volunteer's samples/s (default: the preset's measured speed)"),
          target_batch: Optional[int] = typer.Option(None, help="samples per round (default: the preset's recipe)"),
          prices: Optional[str] = typer.Option(None, help="a JSON price table replacing the built-in one "
                                               "(docs/cost.md)"),
          bucket: Optional[str] = typer.Option(None, help="read the config of --run in this bucket instead"),
          run: Optional[str] = typer.Option(None, help="with --bucket: the run whose config is priced"),
          endpoint_url: Optional[str] = EndpointOpt,
          reduce_s: Optional[float] = typer.Option(None, help="seconds from CLOSE to COMMIT (default: benchmark "
                                                   "5's fit)"),
          micro_batch: Optional[int] = typer.Option(None, help="the volunteers' micro-batch (default: the run's): "
                                                    "a worker polls and heartbeats between micro-batches"),
          uplink_mbit: float = typer.Option(20.0, help="a volunteer's upload speed, Mbit/s"),
          scheduler_poll: Optional[float] = typer.Option(None, help="the scheduler's fixed poll interval "
                                                         "(default: the run's cadence)"),
          scheduler_in_region: bool = typer.Option(False, help="the scheduler runs in the provider's region: "
                                                   "its reads are no egress"),
          aggregators: int = typer.Option(0, help="volunteer aggregators, two to a part (docs/aggregators.md); "
                                          "0: the organizer aggregates"),
          chunks_per_part: Optional[int] = typer.Option(None, min=1, help="chunks a part holds (default: the "
                                                        "recipe's), the chunks as many times smaller: the audits "
                                                        "of volunteer aggregators recompute a share of them"),
          as_json: bool = typer.Option(False, "--json", help="one JSON object")):
    """Price a collaboration in dollars at S3 and R2: requests, egress and storage, per volunteer-day and for the run."""  # noqa: E501
    setup(False)
    from ..planning.display import show
    from ..planning.estimate import estimate
    from ..planning.prices import PRICES, load_prices
    if bucket is not None or run is not None:
        if bucket is None or run is None:
            raise ValueError("--bucket and --run go together: the run whose config is priced")
        if preset is not None or target_batch is not None:
            raise ValueError("--bucket reads the run's own config: drop --preset and --target-batch")
        config = open_run(bucket, run, endpoint_url).config
    else:
        config = recipe_config("plan", preset or "tiny", target_batch_size=target_batch)
    if chunks_per_part is not None:  # a part of the same size, cut into more chunks
        size = max(config.block_size, config.chunk_size * config.chunks_per_part // chunks_per_part
                   // config.block_size * config.block_size)
        config = config.model_copy(update={"chunk_size": size, "chunks_per_part": chunks_per_part})
    table = load_prices(prices) if prices else PRICES
    e = estimate(config, peers, days, samples_per_s, prices=table, reduce_s=reduce_s, uplink_mbit_s=uplink_mbit,
                 scheduler_poll_s=scheduler_poll, micro_batch=micro_batch, scheduler_egress=not scheduler_in_region,
                 aggregators=aggregators)
    if as_json:
        typer.echo(e.model_dump_json())
        return
    from rich.console import Console
    show(e, table, Console())
