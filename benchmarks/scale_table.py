"""Scale on paper: diloco with sparse updates for 125M, 1B and 7B parameters and 40 or 400 volunteers.

Every number in the table comes from a unit cost and a formula here; each unit says where it was
measured. What this machine cannot measure (a volunteer's GPU) is an assumption, named as one,
that benchmark 10 (``benchmarks/gpu_volunteer.sh``) replaces when a GPU is lent.

A volunteer's round: ``H`` inner steps of ``INNER`` sequences of ``SEQ`` tokens, computed in
``C = H * INNER * SEQ / tokens_per_s`` seconds. With delayed updates a volunteer computes while
its shard uploads, the round is reduced and the next state downloads, so a round lasts
``max(C, up + aggregate + down)`` and the compute use is ``C`` over that; without them the two add.
Requests come from the cost model (``planning/``: the cadence's reads and heartbeats
for a round of that length, and every object of the shard and delta layouts).
``python -m benchmarks.scale_table`` prints the table docs/diloco.md holds (a test keeps them equal);
``--measure`` times the aggregator's unit costs on this machine again.
"""

from __future__ import annotations

import typer

MODELS = {"125M": "causal-125m", "1B": "causal-1b", "7B": "causal-7b"}
VOLUNTEERS = (40, 400)
LINKS = {"10/50": (10e6, 50e6), "100/500": (100e6, 500e6)}  # household up/down, bits per second
H, INNER, SEQ = 100, 16, 1024  # inner steps per round, sequences per inner step, tokens per sequence

# Bytes per parameter of a sparse shard and of a sparse delta as stored (lz4 and metadata included):
# benchmark 9's causal-tiny pseudo-gradients and deltas, as the workers' buckets counted them
# (docs/benchmarks.md section 9).
SPARSE_UP, SPARSE_DOWN = 0.031, 0.035
# Aggregator CPU-seconds per parameter, one thread, file:// bucket (``--measure``, 2026-12-02, this
# 2-core machine): reading and adding one sparse shard; then once per round the mean's write and
# read, reading params, momentum and residual, the Nesterov step, the sparse delta with its error
# feedback, and writing params, momentum, residual and delta.
PER_SHARD_S = 1.3e-9
PER_ROUND_S = 80e-9
AGGREGATOR_THREADS = 16  # one 16-core machine, or 16 Prefect task workers: parts reduce independently
PART = 1 << 22  # elements an aggregator task owns (chunks_per_part x chunk_size)
TASK_BYTES_PER_ELEMENT = 36  # float64 sum, then ~7 float32 vectors of the part while applying
# Assumed, not measured here: a 16 GB consumer GPU (RTX 4080 class, ~50 TFLOP/s dense bf16) at 40%
# model FLOPs utilisation, 6 FLOPs per parameter per token (forward and backward).
GPU_FLOPS = 20e12
# Memory of a bf16 volunteer (``--precision bf16``): weights 2, gradients 2, AdamW moments 4 bytes
# per parameter; activations per layer of one sequence without recomputation, 16-bit
# (Korthikanti et al. 2022): SEQ * hidden * (34 + 5 * heads * SEQ / hidden) bytes; the fp32 logits.
# On the host: state r and the error feedback (fp32), and the pseudo-gradient's copy.
STATE_BYTES, HOST_BYTES = 8, 12


def _activations(c: dict) -> float:
    h, a, layers, v = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["vocab_size"]
    return layers * SEQ * h * (34 + 5 * a * SEQ / h) + 3 * SEQ * v * 4


def row(model: str, volunteers: int, link: str) -> dict:
    from dedloc_pipeline.model.presets import PRESETS
    from dedloc_pipeline.planning.estimate import HOUR, estimate
    from dedloc_pipeline.planning.planned import n_params
    from dedloc_pipeline.protocol.config import recipe_config

    preset = MODELS[model]
    n, c = n_params(preset), PRESETS[preset]
    up_bps, down_bps = LINKS[link]
    tokens_per_s = GPU_FLOPS / (6 * n)
    compute_s = H * INNER * SEQ / tokens_per_s
    up_b, down_b = SPARSE_UP * n, SPARSE_DOWN * n
    up_s, down_s = up_b * 8 / up_bps, down_b * 8 / down_bps
    aggregate_cpu_s = n * (PER_ROUND_S + volunteers * PER_SHARD_S)
    aggregate_s = aggregate_cpu_s / AGGREGATOR_THREADS
    settle_s = up_s + aggregate_s + down_s
    round_s = max(compute_s, settle_s)
    config = recipe_config("paper", preset, seq_len=SEQ, inner_batch=INNER, target_batch_size=volunteers * H * INNER,
                           micro_batch=INNER, chunk_size=PART)
    e = estimate(config, volunteers, days=1, samples_per_s=tokens_per_s / SEQ, n=n, reduce_s=aggregate_s,
                 uplink_mbit_s=up_bps / 1e6, shard_bytes_per_param=SPARSE_UP, delta_bytes_per_param=SPARSE_DOWN)
    per_round = e.round_s / HOUR
    return {"model": model, "n_params": n, "volunteers": volunteers, "link": link,
            "up_MB": up_b / 1e6, "down_MB": down_b / 1e6, "compute_s": compute_s, "up_s": up_s, "down_s": down_s,
            "aggregate_s": aggregate_s, "round_s": round_s, "compute_use": compute_s / round_s,
            "compute_use_without_overlap": compute_s / (compute_s + settle_s),
            "aggregator_task_MB": PART * TASK_BYTES_PER_ELEMENT / 1e6, "aggregator_tasks": -(-n // PART),
            "volunteer_requests": sum(e.volunteer_hour.requests.values()) * per_round,
            "scheduler_requests": sum(e.scheduler_hour.requests.values()) * per_round,
            "gpu_GB": (STATE_BYTES * n + _activations(c)) / 1e9, "host_GB": HOST_BYTES * n / 1e9,
            "tokens_per_s": tokens_per_s}


def rows() -> list[dict]:
    return [row(m, v, link) for m in MODELS for v in VOLUNTEERS for link in LINKS]


def markdown() -> str:
    head = ("| model | volunteers | link (Mbit/s) | up MB/round | down MB/round | compute s | up + aggregate + down s "
            "| compute use | without overlap | aggregator CPU tasks × MB | requests/round: volunteer, scheduler "
            "| volunteer GPU GB (bf16) | host GB |\n|" + "---|" * 13 + "\n")
    lines = []
    for r in rows():
        lines.append(f"| {r['model']} | {r['volunteers']} | {r['link']} | {r['up_MB']:.0f} | {r['down_MB']:.0f} "
                     f"| {r['compute_s']:.0f} | {r['up_s']:.0f} + {r['aggregate_s']:.0f} + {r['down_s']:.0f} "
                     f"| {r['compute_use']:.0%} | {r['compute_use_without_overlap']:.0%} "
                     f"| {r['aggregator_tasks']} × {r['aggregator_task_MB']:.0f} "
                     f"| {r['volunteer_requests']:.0f}, {r['scheduler_requests']:.0f} "
                     f"| {r['gpu_GB']:.1f} | {r['host_GB']:.0f} |")
    return head + "\n".join(lines) + "\n"


def measure() -> dict:
    """The aggregator's unit costs on this machine: seconds per parameter, one thread."""
    import tempfile
    import time

    import numpy as np
    import torch

    from dedloc_pipeline.compute import optim
    from dedloc_pipeline.model.flat import Tensor
    from dedloc_pipeline.protocol.config import Outer
    from dedloc_pipeline.storage import codec, vector
    from dedloc_pipeline.storage.bucket import Bucket

    torch.set_num_threads(1)
    n = PART
    rng = np.random.default_rng(0)
    x = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    p = rng.standard_normal(n).astype(np.float32)

    def best(f, k: int = 3) -> float:
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times) / n

    class One:  # the part as one tensor
        def pieces(self, lo, hi):
            yield Tensor("w", (n,), 0, n, True), lo, hi

    b = Bucket(f"file://{tempfile.mkdtemp()}/b")
    dense, shard = vector.VectorFormat("none", n, n, 4096), vector.VectorFormat("sparse", n, n, 4096, whole=True)
    arrays, total, state = codec.encode(x, "sparse", 4096), np.zeros(n), {"momentum_buffer": np.zeros(n, np.float32)}
    vector.write_vector(b, "s", shard, arrays)
    write = best(lambda: vector.write_vector(b, "v", dense, {"values": p}))
    read = best(lambda: vector.read_vector(b, "v", dense))
    per_shard = best(lambda: vector.read_vector(b, "s", shard, raw=True)) + best(
        lambda: codec.accumulate(total, arrays, "sparse", 4096, 1.0))
    apply = best(lambda: optim.apply(Outer().optimizer(), One(), 0, p, state, x, 1))
    delta = best(lambda: codec.delta_encode(p, p + x, "sparse", 4096, None))
    return {"per_shard_s": per_shard, "per_round_s": write + read + 3 * read + apply + delta + 3 * write + write / 5,
            "volunteer_encode_s": best(lambda: codec.encode(x, "sparse", 4096))}


def main(measure_units: bool = typer.Option(False, "--measure", help="time the aggregator's unit costs here")):
    if measure_units:
        print(measure())
    else:
        print(markdown(), end="")


if __name__ == "__main__":
    typer.run(main)
