"""Throughput of hivemind 1.1.12 collaborative training on this project's benchmark workload.

N peers (default 4) run as separate OS processes on this machine, each with its own hivemind.DHT
(on 127.0.0.1, joined through the first peer's address) and one torch thread. They train the same
thing as our own benchmark: the ``tiny`` ALBERT preset (seed 0), SyntheticSource data (seed 0,
sequence 128, one stream per peer), the summed pretraining loss divided by the micro-batch (8),
AdamW (lr 5e-4, weight decay 0.01), a global batch of 256 per optimizer step
(``use_local_updates=False``: one real large-batch step per target), and 8-bit blockwise
gradient and state compression.

After ``warmup`` global steps (``optimizer.local_epoch`` advancing), each peer measures the next
``rounds`` ones: wall time, the samples it computed and its time in forward + backward. The
parent reports samples/s as the samples all peers actually computed in that window divided by
the window (``samples_per_s_target`` is target x rounds / window), seconds per global step, and
the mean compute fraction. With ``hosts`` (one address per peer) and ``prefixes`` (what each
peer's command line starts with, e.g. ``ip netns exec NS``) the peers run on links of their own,
as in benchmark 6 (benchmarks/shaped.py); each then also counts the bytes its network interfaces
sent and received in the window, which the parent reports per parameter per global step. Slow
links need longer ``averaging_timeout`` and ``next_chunk_timeout``: by default hivemind gives a
sender only ``matchmaking_time`` (1 s) per 512 kB part, then averages without it, silently.
Peers exit cleanly (optimizer and DHT shut down); on failure or timeout the parent kills every
process group it started.

``python -m benchmarks.hivemind_peers`` runs ``run()`` and prints the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING = "hivemind is not installed: make bench installs the bench extra (hivemind==1.1.12)"
BLOCK = 4096  # values per absmax scale, as the project's int8 codec (RunConfig.block_size)
MATCHMAKING_S = 1.0  # as in NOTES; hivemind warns that its request_timeout (3 s) is longer
AVERAGING_TIMEOUT_S = 30.0  # an all-reduce here takes 1-3 s
# Delayed parameter updates (both on) measured fastest here (4 peers, 2 shared cores): 15.7 and
# 16.0 samples/s, compute fraction 0.89 and 0.92; both off: 15.7 and 15.5 (0.75, 0.78);
# delay_optimizer_step alone: 13.7 (0.65). Compare with --delay-step=0 --delay-grads=0.
DELAY_OPTIMIZER_STEP = True
DELAY_GRAD_AVERAGING = True


def run(peers: int = 4, micro_batch: int = 8, target: int = 256, warmup: int = 2, rounds: int = 5,
        timeout_s: float = 420, preset: str = "tiny", hosts: list[str] | None = None,
        prefixes: list[list[str]] | None = None, averaging_timeout: float = AVERAGING_TIMEOUT_S,
        next_chunk_timeout: float | None = None) -> dict:
    """Run one collaboration of ``peers`` processes and return its throughput (JSON-able)."""
    return _run(peers, micro_batch, target, warmup, rounds, timeout_s,
                DELAY_OPTIMIZER_STEP, DELAY_GRAD_AVERAGING, preset, hosts, prefixes, averaging_timeout,
                next_chunk_timeout)


def _run(peers, micro_batch, target, warmup, rounds, timeout_s, delay_step, delay_grads, preset="tiny",
         hosts=None, prefixes=None, averaging_timeout=AVERAGING_TIMEOUT_S, next_chunk_timeout=None) -> dict:
    try:
        import hivemind  # noqa: F401  (only to fail early and clearly)
    except ImportError as e:
        raise ImportError(MISSING) from e
    began = time.monotonic()
    deadline = began + timeout_s
    work = Path(tempfile.mkdtemp(prefix="hivemind-bench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    common = [f"--peers={peers}", f"--micro-batch={micro_batch}", f"--target={target}",
              f"--warmup={warmup}", f"--rounds={rounds}", f"--work={work}",
              f"--delay-step={int(delay_step)}", f"--delay-grads={int(delay_grads)}", f"--preset={preset}",
              f"--averaging-timeout={averaging_timeout}",
              *([f"--next-chunk-timeout={next_chunk_timeout}"] if next_chunk_timeout else [])]
    procs: list[subprocess.Popen] = []

    def start(i: int, initial: str) -> None:
        log = open(work / f"peer{i}.log", "wb")
        # own session: the peer's p2pd and hivemind child processes share its process group
        procs.append(subprocess.Popen(
            [*(prefixes[i] if prefixes else []), sys.executable, "-m", "benchmarks.hivemind_peers", f"--peer={i}",
             f"--initial={initial}", f"--host={hosts[i] if hosts else '127.0.0.1'}", *common],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def wait_for(names: list[str], what: str) -> None:
        while not all((work / n).exists() for n in names):
            dead = [i for i, p in enumerate(procs)
                    if p.poll() is not None and not (work / f"peer{i}.json").exists()]
            if dead or time.monotonic() > deadline:
                why = f"peer(s) {dead} exited" if dead else f"timed out after {timeout_s:.0f} s"
                _kill(procs)
                raise RuntimeError(f"hivemind benchmark failed waiting for {what}: {why}\n"
                                   + _tails(work, peers))
            time.sleep(0.2)

    try:
        start(0, "")
        wait_for(["maddrs"], "the first peer's DHT")
        for i in range(1, peers):
            start(i, (work / "maddrs").read_text())
        wait_for([f"ready{i}" for i in range(peers)], "all peers to be ready")
        (work / "go").touch()  # a common start, so no peer fills the first steps alone
        wait_for([f"peer{i}.json" for i in range(peers)], "the measured steps")
        (work / "stop").touch()  # no one leaves while another still measures
        for p in procs:
            try:
                p.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        exit_codes = [p.poll() for p in procs]
    finally:
        _kill(procs)
    stats = [json.loads((work / f"peer{i}.json").read_text()) for i in range(peers)]
    groups = _group_sizes(work, stats)
    shutil.rmtree(work, ignore_errors=True)  # kept on failure: the error names the logs
    window = sum(s["t_end"] - s["t_start"] for s in stats) / peers
    samples = sum(s["samples"] for s in stats)
    # on loopback every peer's traffic shares one interface, so bytes mean something only on own links
    wire = {f"{way}_bytes_per_param": sum(s[key] for s in stats) / peers / rounds / stats[0]["n_params"]
            for way, key in (("up", "net_sent"), ("down", "net_recv"))} if hosts else {}
    return {
        "system": "hivemind 1.1.12", "peers": peers, "micro_batch": micro_batch, "target": target,
        "rounds": rounds,
        "samples_per_s": samples / window,
        "s_per_round": window / rounds,
        "compute_fraction": sum(s["compute_s"] / (s["t_end"] - s["t_start"]) for s in stats) / peers,
        "samples_per_s_target": target * rounds / window,
        **wire,
        "settings": {
            "samples_per_s": "samples computed by all peers between the end of warm-up and the end, "
                             "over that window (mean of the peers' windows)",
            "warmup": warmup, "model": preset, "seq_len": 128, "data": "SyntheticSource seed 0",
            "optimizer": "AdamW lr 5e-4 wd 0.01", "use_local_updates": False,
            "compression": f"8-bit blockwise, absmax per {BLOCK} values (grads and state averaging)",
            "matchmaking_time": MATCHMAKING_S, "averaging_timeout": averaging_timeout,
            "next_chunk_timeout": next_chunk_timeout or MATCHMAKING_S,
            "delay_optimizer_step": delay_step, "delay_grad_averaging": delay_grads,
            "torch_threads_per_peer": 1, "host": " ".join(hosts) if hosts else "127.0.0.1",
            "cpu_count": os.cpu_count(),
            "samples_per_peer": [s["samples"] for s in stats],
            "compute_fraction_per_peer": [round(s["compute_s"] / (s["t_end"] - s["t_start"]), 3)
                                          for s in stats],
            **groups, "peer_exit_codes": exit_codes, "wall_s": round(time.monotonic() - began, 1),
        },
    }


def _kill(procs: list[subprocess.Popen]) -> None:
    """End every process group this run started (each peer leads its own session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for p in alive:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:  # p2pd daemons and forked helpers left behind by peers that did exit
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _group_sizes(work: Path, stats: list[dict]) -> dict:
    """How many peers each gradient averaging in the measured window actually joined.

    hivemind splits a collaboration into smaller groups when matchmaking is short, or falls back
    to local gradients: then a "global" step is not one average over the whole target batch.
    Counted from the peers' logs (one line per peer and averaging), between the window's ends.
    """
    sizes, local = [], 0
    for i, s in enumerate(stats):
        for line in (work / f"peer{i}.log").read_text(errors="replace").splitlines():
            m = re.match(r"(\w{3} +\d+ [\d:.]+) \[\w+\] (.*)", line)
            if not m:
                continue
            stamp = datetime.strptime(f"{s['year']} {m[1]}", "%Y %b %d %H:%M:%S.%f").timestamp()
            if s["wall_start"] <= stamp <= s["wall_end"]:
                n = re.match(r"Averaged gradients with (\d+) peers", m[2])
                sizes += [int(n[1])] if n else []
                local += m[2].startswith("Proceeding with local gradients")
    return {"grad_group_sizes": {str(n): sizes.count(n) for n in sorted(set(sizes))},
            "local_gradient_fallbacks": local}


def _tails(work: Path, peers: int, lines: int = 15) -> str:
    out = []
    for i in range(peers):
        log = work / f"peer{i}.log"
        text = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else ["(no log)"]
        out.append(f"--- peer {i} ({log}) ---\n" + "\n".join(text))
    return "\n".join(out)


def _blockwise_codec():
    """An 8-bit blockwise codec for hivemind, registered as its BLOCKWISE_8BIT wire type.

    hivemind 1.1.12's own BlockwiseQuantization needs bitsandbytes (not in the bench extra), and
    every 8-bit codec it ships fails to decode under NumPy >= 2.4 (``int()`` of a one-element
    array). This one codes like the project's int8 codec: int8 values times one absmax/127
    scale per block. It must be registered before the averagers fork.
    """
    import numpy as np
    import torch
    from hivemind.compression import CompressionBase, serialization
    from hivemind.proto import runtime_pb2

    class Blockwise8Bit(CompressionBase):
        compression_type = runtime_pb2.BLOCKWISE_8BIT

        def compress(self, tensor, info, allow_inplace=False):
            x = tensor.detach().float().reshape(-1)
            nb = -(-x.numel() // BLOCK)
            blocks = torch.nn.functional.pad(x, (0, nb * BLOCK - x.numel())).view(nb, BLOCK)
            scales = blocks.abs().amax(1) / 127
            codes = (blocks / scales.clamp_min(1e-30)[:, None]).round_().clamp_(-127, 127).to(torch.int8)
            buffer = b"".join((np.int64(nb).tobytes(), scales.numpy().tobytes(),
                               codes.view(-1)[: x.numel()].numpy().tobytes()))
            return runtime_pb2.Tensor(compression=self.compression_type, buffer=buffer, size=tensor.shape,
                                      dtype=str(tensor.dtype).removeprefix("torch."),
                                      requires_grad=tensor.requires_grad)

        def extract(self, serialized):
            buf = serialized.buffer
            nb = int(np.frombuffer(buf, np.int64, 1)[0])
            scales = torch.from_numpy(np.frombuffer(buf, np.float32, nb, 8).copy())
            codes = torch.from_numpy(np.frombuffer(buf, np.int8, offset=8 + 4 * nb).copy())
            x = codes.float() * scales.repeat_interleave(BLOCK)[: codes.numel()]
            return x.reshape(tuple(serialized.size)).to(getattr(torch, serialized.dtype))

        def estimate_compression_ratio(self, info):
            return 0.25

    codec = Blockwise8Bit()
    serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = codec
    return codec


def _link_bytes() -> tuple[int, int]:
    """(sent, received) over this network namespace's interfaces but loopback."""
    import psutil

    nics = [c for nic, c in psutil.net_io_counters(pernic=True).items() if nic != "lo"]
    return sum(c.bytes_sent for c in nics), sum(c.bytes_recv for c in nics)


def _peer(a: argparse.Namespace) -> None:
    """One volunteer: train until the measured window is over and the parent says stop."""
    import torch

    torch.set_num_threads(1)
    import hivemind

    from dedloc_pipeline.model.albert import build_model, pretraining_loss_sum
    from dedloc_pipeline.model.data import SyntheticSource

    work = Path(a.work)
    model = build_model(a.preset, seed=0)
    src = SyntheticSource(vocab_size=model.config.vocab_size, seq_len=128, seed=0)
    codec = _blockwise_codec()
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{a.host}/tcp/0"],
                       initial_peers=a.initial.split() if a.initial else None)
    if a.peer == 0:
        (work / "maddrs.tmp").write_text(" ".join(str(m) for m in dht.get_visible_maddrs()))
        (work / "maddrs.tmp").rename(work / "maddrs")
    opt = hivemind.Optimizer(
        dht=dht, run_id="dedloc-bench", target_batch_size=a.target, batch_size_per_step=a.micro_batch,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-4, weight_decay=0.01),
        matchmaking_time=MATCHMAKING_S, averaging_timeout=a.averaging_timeout,
        next_chunk_timeout=a.next_chunk_timeout,
        use_local_updates=False, delay_optimizer_step=bool(a.delay_step),
        delay_grad_averaging=bool(a.delay_grads), grad_compression=codec,
        state_averaging_compression=codec, verbose=True)
    (work / f"ready{a.peer}").touch()
    while not (work / "go").exists():
        time.sleep(0.05)

    first, last = a.warmup, a.warmup + a.rounds
    cursor, samples, compute_s, t_start, t_end = 0, 0, 0.0, None, None
    try:
        while not (work / "stop").exists():
            batch = src.batch(stream=f"peer{a.peer}", start=cursor, count=a.micro_batch)
            cursor += a.micro_batch
            t0 = time.perf_counter()
            # the loss is a sum over samples; hivemind averages micro-batch gradients as means
            (pretraining_loss_sum(model, batch) / a.micro_batch).backward()
            dt = time.perf_counter() - t0
            in_window = t_start is not None and t_end is None
            opt.step()
            opt.zero_grad()
            if in_window:
                samples += a.micro_batch
                compute_s += dt
            epoch, now = opt.local_epoch, time.monotonic()
            if t_start is None and epoch >= first:
                t_start, wall_start, link_start = now, time.time(), _link_bytes()
            if t_end is None and epoch >= last:
                t_end = now
                sent, received = (b - b0 for b, b0 in zip(_link_bytes(), link_start))
                (work / f"peer{a.peer}.json.tmp").write_text(json.dumps(
                    {"t_start": t_start, "t_end": t_end, "samples": samples, "compute_s": compute_s,
                     "epoch": epoch, "wall_start": wall_start, "wall_end": time.time(),
                     "year": time.localtime().tm_year, "net_sent": sent, "net_recv": received,
                     "n_params": sum(p.numel() for p in model.parameters())}))
                (work / f"peer{a.peer}.json.tmp").rename(work / f"peer{a.peer}.json")
    finally:
        opt.shutdown()
        dht.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", type=int, help="internal: run as peer number PEER")
    for name, default in (("peers", 4), ("micro-batch", 8), ("target", 256), ("warmup", 2), ("rounds", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--initial", default="")
    p.add_argument("--host", default="127.0.0.1", help="internal: the address this peer listens on")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--averaging-timeout", type=float, default=AVERAGING_TIMEOUT_S)
    p.add_argument("--next-chunk-timeout", type=float, default=None, help="default: hivemind's (matchmaking time)")
    p.add_argument("--work", default="")
    p.add_argument("--delay-step", type=int, default=int(DELAY_OPTIMIZER_STEP))
    p.add_argument("--delay-grads", type=int, default=int(DELAY_GRAD_AVERAGING))
    p.add_argument("--timeout", type=float, default=420)
    a = p.parse_args()
    if a.peer is not None:
        _peer(a)
    else:
        print(json.dumps(_run(a.peers, a.micro_batch, a.target, a.warmup, a.rounds, a.timeout,
                              bool(a.delay_step), bool(a.delay_grads), a.preset,
                              averaging_timeout=a.averaging_timeout, next_chunk_timeout=a.next_chunk_timeout),
                         indent=2))


if __name__ == "__main__":
    main()
