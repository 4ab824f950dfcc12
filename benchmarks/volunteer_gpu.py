"""Benchmark 10 (GPU, not in `make bench`): one volunteer of a diloco run of the 1B preset.

The real worker (``volunteer/worker.py``) on a CUDA device, in a run of ``causal-1b`` with sparse
pseudo-gradients on a local bucket and synthetic running text, fills one round of ``h`` inner
steps of ``inner_batch`` sequences alone (no scheduler: with no round view a volunteer's round
fills from its own samples) and uploads its shard. Measured: tokens per second of computing
(forward, backward, inner steps), the round's overhead (the pseudo-gradient's copy to the host,
its encoding and upload: seconds a round pays whatever ``h``), the compute fraction at this
``h``, the GPU's peak memory and the shard's bytes. docs/diloco.md's scale table takes the first
two. Run by ``benchmarks/gpu_volunteer.sh`` on a lent GPU; on a CPU with ``--preset causal-tiny``
as a check.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


@app.command()
def main(preset: str = "causal-1b", device: str = "cuda", precision: str = "bf16", seq: int = 1024,
         micro_batch: int = 4, inner_batch: int = 16, h: int = 8, out: str = ".dedloc/bench/volunteer-gpu") -> None:
    import torch

    from dedloc_pipeline.protocol.config import recipe_config
    from dedloc_pipeline.protocol.run import init_run
    from dedloc_pipeline.storage.bucket import Bucket
    from dedloc_pipeline.volunteer.worker import Worker

    t0 = time.monotonic()
    bucket = Bucket(f"file://{tempfile.mkdtemp(prefix='dedloc-gpu-')}/bucket")
    cfg = recipe_config("gpu", preset, seq_len=seq, algorithm="diloco", codec="sparse", inner_batch=inner_batch,
                        target_batch_size=h * inner_batch, micro_batch=micro_batch, chunk_size=1 << 22,
                        delayed_updates=False)
    run = init_run(bucket, cfg)
    w = Worker(run, "gpu", device=device, poll_s=0, precision=precision)
    w.sync()
    setup_s = time.monotonic() - t0
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    compute0, t1 = w.compute_s, time.monotonic()
    while not w.uploads:
        w.step()
        w.flush()
    wall, compute = time.monotonic() - t1, w.compute_s - compute0
    samples = cfg.target_batch_size
    res = {"preset": preset, "n_params": run.flat.n, "device": torch.cuda.get_device_name() if device.startswith("cuda")
           else device, "precision": precision, "seq": seq, "micro_batch": micro_batch, "inner_batch": inner_batch,
           "h": h, "setup_s": setup_s, "wall_s": wall, "compute_s": compute,
           "tokens_per_s_computing": samples * seq / compute, "round_overhead_s": wall - compute,
           "compute_fraction": compute / wall,
           "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
           "shard_bytes_per_param": sum(bucket.sizes(w.uploads[0][1]).values()) / run.flat.n}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "volunteer.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    app()
