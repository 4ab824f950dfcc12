"""`make quality`: does pretraining pay, and does the collaboration train as well as one process?

A collaboration of ``peers`` volunteers (one ``dedloc aggregate``, ``peers`` ``dedloc worker``
processes, int8 shards and int4 deltas, delayed updates: the defaults) pretrains on the embedded
Bengali corpus. Beside it, the same pretraining in one process at the same samples: each round's
accepted samples (as its CLOSE names them) summed into one fresh gradient on that state's
parameters, fp32, and torch's AdamW at the run's learning rates; nothing of shards, codecs or
staleness. Both are scored on the held-out split at every state the run keeps, against the samples
taken so far, and both (and random init) are fine-tuned on the two downstream stand-ins. Results:
a table on screen, ``quality.json`` and ``quality.png`` in ``--out``.

On a GPU (``--device cuda``, e.g. ``--preset sahajbert``; benchmarks/gpu_quality.sh) the same
measurement also reports the workers' samples/s and compute fraction over a fixed budget of rounds.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from . import collab

app = typer.Typer(add_completion=False)
TASKS = ("ner", "news")


def make_data(url: str, corpus_dir: str, vocab_size: int, seq_len: int, name: str = "bengali") -> dict:
    """The tokenize flow's steps, without Prefect: the tokenizer and the data set in ``url``."""
    from dedloc_pipeline.dataset.build import Recipe, make
    from dedloc_pipeline.dataset.sources import embedded
    from dedloc_pipeline.storage.bucket import Bucket

    recipe = Recipe(sources=(embedded(corpus_dir),), vocab_size=vocab_size, seq_len=seq_len)
    return make(Bucket(url), name, recipe)


def one_process(run, states: list[int], threads: int, micro_batch: int = 16) -> dict[int, np.ndarray]:
    """Parameters at ``states`` of the same pretraining in one process at the same samples."""
    import torch

    from dedloc_pipeline.compute.optim import lr_at
    from dedloc_pipeline.model.albert import pretraining_loss_sum
    from dedloc_pipeline.model.data import make_source
    from dedloc_pipeline.model.flat import FlatLayout

    torch.set_num_threads(threads)
    oc = run.config.optimizer
    if oc.name != "adamw":
        raise ValueError("the one-process reference steps torch's AdamW; this run uses " + oc.name)
    model = run.build_model()
    flat = FlatLayout(model)
    flat.set(run.load_params(0))
    source = make_source(run)
    named = dict(model.named_parameters())
    decay = {t.name: t.decay for t in flat.tensors}
    opt = torch.optim.AdamW([{"params": [p for n, p in named.items() if decay[n] == d],
                              "weight_decay": oc.weight_decay if d else 0.0} for d in (True, False)],
                            lr=oc.lr, betas=oc.betas, eps=oc.eps)
    kept = {0: flat.get()}
    for r in range(max(states)):
        close = run.bucket.read_json(run.keys.close(r))
        model.zero_grad()
        for s in close["accepted"]:
            for start, count in s["data"]["ranges"]:
                for i in range(start, start + count, micro_batch):
                    batch = source.batch(s["data"]["stream"], i, min(micro_batch, start + count - i))
                    (pretraining_loss_sum(model, batch) / close["samples"]).backward()
        for group in opt.param_groups:
            group["lr"] = lr_at(oc, r + 1)
        opt.step()
        if r + 1 in states:
            kept[r + 1] = flat.get()
    return kept


def encoder_of(run, params: np.ndarray) -> dict:
    from dedloc_pipeline.model.flat import FlatLayout
    model = run.build_model()
    FlatLayout(model).set(params)
    return model.albert.state_dict()


def finetune_all(run, encoders: dict[str, dict | None], corpus_dir: str, options: dict) -> dict:
    """Each task fine-tuned from each encoder (None: random init), the same seed and head init."""
    from dedloc_pipeline.evaluation import downstream
    from dedloc_pipeline.evaluation.export import run_tokenizer
    from dedloc_pipeline.evaluation.heldout import task_data

    tok, config = run_tokenizer(run), run.build_model().config
    out: dict = {}
    for task in TASKS:
        data = task_data(task, "offline", corpus_dir)
        for name, enc in encoders.items():
            res = downstream.finetune(data, tok, config, enc, seed=run.config.seed, **options)
            out.setdefault(task, {"metric": res["metric"], "source": res["source"]})[name] = res["test"]
    return out


def figure(res: dict) -> bytes:
    from matplotlib.figure import Figure

    from dedloc_pipeline.monitoring.plots import png

    fig = Figure(figsize=(10 if res["downstream"] else 6, 4), dpi=100, layout="constrained")
    curve, bars = fig.subplots(1, 2, width_ratios=[3, 2]) if res["downstream"] else (fig.subplots(), None)
    x = res["curve"]["samples"]
    curve.plot(x, res["curve"]["collaboration"], "o-", markersize=3, label=f"collaboration ({res['peers']} volunteers)")
    if res["curve"].get("one_process"):
        curve.plot(x, res["curve"]["one_process"], "s--", markersize=3, label="one process, same samples")
    curve.axhline(res["unigram_entropy"], color="gray", linestyle=":", label="unigram entropy")
    curve.set(title="held-out masked-LM loss", xlabel="samples", ylabel="loss (nats)")
    curve.grid(alpha=0.3)
    curve.legend(fontsize="small")
    if bars is not None:
        names = [n for n in ("random_init", "one_process", "collaboration")
                 if any(n in v for v in res["downstream"].values())]
        for i, name in enumerate(names):
            bars.bar(np.arange(len(TASKS)) + (i - 1) * 0.27, [res["downstream"][t].get(name, 0) for t in TASKS],
                     width=0.27, label=name.replace("_", " "))
        bars.set_xticks(range(len(TASKS)), [f"{t} ({res['downstream'][t]['metric']})" for t in TASKS])
        bars.set(title="fine-tuned, test split", ylim=(0, 1))
        bars.legend(fontsize="small")
    return png(fig)


def table(res: dict):
    from rich.table import Table
    t = Table(title=f"quality: {res['preset']}, {res['peers']} volunteers, {res['rounds']} rounds, "
                    f"{res['samples']} samples, sequence {res['seq_len']}", title_justify="left")
    for c in ("", "random init", "one process", "collaboration"):
        t.add_column(c, justify="right" if c else "left")
    c = res["curve"]
    t.add_row("held-out MLM loss", f"{c['collaboration'][0]:.4f}",
              f"{c['one_process'][-1]:.4f}" if c.get("one_process") else "-", f"{c['collaboration'][-1]:.4f}")
    for task, v in res["downstream"].items():
        t.add_row(f"{task} test {v['metric']}", *(f"{v[n]:.4f}" if n in v else "-"
                                                 for n in ("random_init", "one_process", "collaboration")))
    return t


@app.command()
def main(peers: int = 2, rounds: int = 300, target: int = 128, seq_len: int = typer.Option(64, "--seq"),
         preset: str = "tiny", vocab: int | None = typer.Option(2000, help="the tokenizer's (at most the preset's)"),
         lr: float | None = None, warmup: int | None = None, device: str = "cpu",
         micro_batch: int = 8, heldout: int = 256, kept: int = 10, epochs: int = 10,
         reference: bool = typer.Option(True, help="the one-process pretraining beside it"),
         finetune: bool = typer.Option(True, help="fine-tune both stand-ins from each encoder"),
         corpus_dir: str = ".dedloc/corpus", out: str = ".dedloc/bench/quality") -> None:
    """Pretrain with a collaboration and with one process, score both held out and downstream."""
    from rich.console import Console

    from dedloc_pipeline.evaluation.heldout import heldout_scores
    from dedloc_pipeline.model.presets import PRESETS
    from dedloc_pipeline.protocol.run import Run
    from dedloc_pipeline.storage.bucket import Bucket

    console, t0 = Console(), time.monotonic()
    url = f"file://{tempfile.mkdtemp(prefix='dedloc-quality-')}/bucket"
    most = PRESETS[preset]["vocab_size"]
    card = make_data(url, corpus_dir, min(vocab or most, most), seq_len)
    console.print(f"data set: {card['splits']['train']['pairs']} training pairs of {seq_len} tokens "
                  f"({time.monotonic() - t0:.0f} s)")
    optimizer = {k: v for k, v in (("lr", lr), ("warmup_steps", warmup)) if v is not None}
    config = {"data": "bengali", "seq_len": seq_len, "checkpoint_every": max(1, rounds // kept),
              "optimizer": optimizer}
    worker_args = ("--device", device, "--micro-batch", str(micro_batch))
    t1 = time.monotonic()
    speed = collab.collaborate(peers=peers, micro_batch=micro_batch, target=target, preset=preset, warmup=1,
                               rounds=rounds - 1, poll=0.5, timeout_s=24 * 3600, url=url, config=config,
                               worker_args=worker_args)
    pretrain_s = time.monotonic() - t1
    run = Run(Bucket(url), "bench")
    states = run.kept_states()
    commits = [run.commit_of(s) for s in range(1, run.latest() + 1)]
    seen = np.cumsum([0] + [c["samples"] for c in commits])
    console.print(f"collaboration: {run.latest()} rounds, {int(seen[-1])} samples in {pretrain_s / 60:.1f} min, "
                  f"{speed['samples_per_s']:.1f} samples/s, compute fraction {speed['compute_fraction']:.2f}")
    threads = os.cpu_count() or 1
    params = {s: run.load_params(s) for s in states}
    curve = {"states": states, "samples": [int(seen[s]) for s in states],
             "collaboration": [heldout_scores(run, params[s], heldout)[0] for s in states]}
    solo = None
    if reference:
        t2 = time.monotonic()
        solo = one_process(run, states, threads)
        curve["one_process"] = [heldout_scores(run, solo[s], heldout)[0] for s in states]
        console.print(f"one process at the same samples: {(time.monotonic() - t2) / 60:.1f} min")
    downstream: dict = {}
    if finetune:
        encoders = {"random_init": None, "collaboration": encoder_of(run, params[states[-1]])}
        if solo is not None:
            encoders["one_process"] = encoder_of(run, solo[states[-1]])
        downstream = finetune_all(run, encoders, corpus_dir, {"epochs": epochs, "seq_len": seq_len})
    res = {"preset": preset, "peers": peers, "device": device, "rounds": run.latest(), "target": target,
           "seq_len": seq_len, "samples": int(seen[-1]), "optimizer": run.config.optimizer.model_dump(),
           "unigram_entropy": card["unigram_entropy"], "pretrain_minutes": pretrain_s / 60,
           "samples_per_s": speed["samples_per_s"], "compute_fraction": speed["compute_fraction"],
           "s_per_round": speed["s_per_round"], "curve": curve, "downstream": downstream,
           "minutes": (time.monotonic() - t0) / 60}
    last = curve["collaboration"][-1]
    res["below_unigram_entropy"] = card["unigram_entropy"] - last
    if solo is not None:
        res["collaboration_minus_one_process"] = last - curve["one_process"][-1]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "quality.json").write_text(json.dumps(res, indent=1))
    (Path(out) / "quality.png").write_bytes(figure(res))
    console.print(table(res))
    gap = res.get("collaboration_minus_one_process")
    console.print(f"held-out loss {res['below_unigram_entropy']:+.3f} nats below the unigram entropy"
                  + ("" if gap is None else f"; collaboration minus one process: {gap:+.4f} nats")
                  + f"; {res['minutes']:.0f} min in all. Written: {out}/quality.json, {out}/quality.png")


if __name__ == "__main__":
    app()
