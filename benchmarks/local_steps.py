"""Benchmark 9: the local-steps mode against the default algorithm, at equal training samples.

The CPU-sized causal decoder (``causal-tiny``) pretrains on the embedded Bengali corpus three
times, each a real collaboration (one ``dedloc aggregate``, ``peers`` ``dedloc worker``
processes, delayed updates), each over the same number of training samples:

- ``default``: one AdamW step per filled batch of ``target`` samples, int8 shards, int4 deltas;
- ``diloco``: every volunteer takes an AdamW step per ``inner_batch`` samples, ``h`` of them in a
  round (so a round is ``peers * h * inner_batch`` samples), int8 pseudo-gradients, int4 deltas,
  and the outer step averages them (``OUTER``: lr 1, no momentum);
- ``diloco + sparse``: the same with the sparse codec up and down.

The outer step is plain averaging because it measured best here (2 volunteers, 32 rounds): DiLoCo's
Nesterov step (lr 0.7, momentum 0.9, the run's default) ended at 6.08 with int8 and 8.24 with the
sparse codec, whose downloads then carry a dense momentum through a 1/64 top-k; averaging ended at
5.17 and 5.60 (default algorithm: 5.88).

Warmup covers the same samples in each (20 default rounds' worth). Reported: the held-out loss of
the last state, and the bytes on the wire per training sample (what the workers' buckets counted
up and down, over the rounds after the first, per sample those rounds committed), with the
ratios to the default algorithm measured in the same run.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from . import collab

PRESET, SEQ, VOCAB = "causal-tiny", 64, 2000
OUTER = {"lr": 1.0, "momentum": 0.0}


def _case(url: str, name: str, peers: int, micro_batch: int, target: int, rounds: int, warmup: int, **config) -> dict:
    from dedloc_pipeline.evaluation.heldout import heldout_scores
    from dedloc_pipeline.protocol.run import Run
    from dedloc_pipeline.storage.bucket import Bucket

    codec = config.pop("codec", "int8")
    config = {"data": "bengali", "seq_len": SEQ, "optimizer": {"lr": 1e-3, "warmup_steps": warmup}, **config}
    speed = collab.collaborate(peers=peers, micro_batch=micro_batch, target=target, preset=PRESET, warmup=1,
                               rounds=rounds - 1, poll=0.5, timeout_s=3 * 3600, url=url, config=config, codec=codec)
    run = Run(Bucket(url), "bench")
    samples = sum(run.commit_of(s)["samples"] for s in range(1, run.latest() + 1))
    wire = (speed["up_bytes_per_param"] + speed["down_bytes_per_param"]) * speed["n_params"]
    per_round = sum(run.commit_of(s)["samples"] for s in range(2, run.latest() + 1)) / (run.latest() - 1)
    return {"name": name, "rounds": run.latest(), "target": target, "samples": samples,
            "heldout_loss": heldout_scores(run, run.load_params(run.latest()), 256)[0],
            "up_bytes_per_param": speed["up_bytes_per_param"], "down_bytes_per_param": speed["down_bytes_per_param"],
            "wire_bytes_per_sample": wire * peers / per_round, "compute_fraction": speed["compute_fraction"],
            "samples_per_s": speed["samples_per_s"], "n_params": speed["n_params"], "codec": codec,
            "algorithm": run.config.algorithm, "inner_batch": run.config.inner_batch}


def run(samples: int = 8192, peers: int = 2, target: int = 128, h: int = 8, inner_batch: int = 16,
        micro_batch: int = 8, corpus_dir: str = ".dedloc/corpus") -> dict:
    from .quality import make_data

    big = peers * h * inner_batch  # a diloco round: h inner steps per volunteer
    cases = [("default", target, {}),
             ("diloco", big, {"algorithm": "diloco", "inner_batch": inner_batch, "outer": OUTER}),
             ("diloco + sparse", big, {"algorithm": "diloco", "inner_batch": inner_batch, "codec": "sparse",
                                       "outer": OUTER})]
    out = {"preset": PRESET, "seq_len": SEQ, "peers": peers, "samples": samples, "h": h, "cases": []}
    data = Path(tempfile.mkdtemp(prefix="dedloc-local-steps-")) / "data"
    out["unigram_entropy"] = make_data(f"file://{data}", corpus_dir, VOCAB, SEQ)["unigram_entropy"]
    for name, t, extra in cases:  # a bucket each, the same data set in each
        bucket = Path(tempfile.mkdtemp(prefix="dedloc-local-steps-")) / "bucket"
        shutil.copytree(data, bucket)
        url = f"file://{bucket}"
        warmup = max(1, 20 * target // t)
        out["cases"].append(_case(url, name, peers, micro_batch, t, max(2, samples // t), warmup, **extra))
    base = out["cases"][0]
    for c in out["cases"]:
        c["loss_vs_default"] = c["heldout_loss"] / base["heldout_loss"] - 1
        c["fewer_bytes_per_sample"] = base["wire_bytes_per_sample"] / c["wire_bytes_per_sample"]
    return out


def table(res: dict):
    from rich.table import Table

    t = Table(title=f"9. local steps: {res['preset']} on Bengali, {res['peers']} volunteers, {res['samples']} "
                    f"samples each, h = {res['h']} inner steps per volunteer per round", title_justify="left")
    for c in ("algorithm", "rounds", "held-out loss", "vs default", "up B/param/round", "wire B/sample", "fewer bytes"):
        t.add_column(c, justify="left" if c == "algorithm" else "right")
    for c in res["cases"]:
        t.add_row(c["name"], str(c["rounds"]), f"{c['heldout_loss']:.4f}", f"{c['loss_vs_default']:+.1%}",
                  f"{c['up_bytes_per_param']:.3f}", f"{c['wire_bytes_per_sample']:,.0f}",
                  f"{c['fewer_bytes_per_sample']:.1f}x")
    return t
