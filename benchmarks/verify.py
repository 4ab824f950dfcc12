"""Verified work (docs/verification.md): tolerances, detection rates and the validator's cost.

1. Tolerances. A real collaboration per shard codec (3 volunteers, delayed updates, so shards
   carry stale samples and the workers' error feedback): every accepted shard is recomputed by
   ``recompute.Recomputer`` with another micro-batch than the worker's (another summation order, as
   another machine would have), and the worst honest 1 - cosine and |norm ratio - 1| are kept.
   The honest pairs' cosines (different volunteers, same round) bound the copy screen.
2. Detection. ``trials`` attacks per kind on the int8 run's committed states, each judged as the
   validator judges a chosen shard (``compare(...).matches(TOLERANCES["int8"])``); copies also
   through the pairwise screen, which sees every shard, drawn or not. With the default fraction,
   the chance a volunteer's shard is drawn in a round of N shards is simulated over random
   COMMIT hashes, and the expected rounds until a volunteer who cheats in every round is flagged
   is 1 / (P(drawn) * detection).
3. Cost. Recompute seconds per sample against the workers' compute seconds per sample
   (``Worker.compute_s``, forward and backward only), and the share of a round's compute the
   validator spends at the default fraction.

``python -m benchmarks.verify [--rounds 4] [--trials 20]`` prints a JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time

import numpy as np

from dedloc_pipeline.protocol import recompute, verify
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.protocol.shard import DataRef, Entry
from dedloc_pipeline.storage import codec
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import volunteer_of
from dedloc_pipeline.testing import TINY, collaborate, small_config

PEERS = [("a", 4), ("b", 3), ("c", 5)]


def make_run(codec_name: str):
    cfg = small_config("bench", **TINY, codec=codec_name, delayed_updates=True, keep_states=100)
    return init_run(Bucket(tempfile.mkdtemp(prefix="verify-bench-")), cfg)


def tolerances(rounds: int) -> tuple[dict, object, dict]:
    """Worst honest error per codec; the int8 run (for the attacks) and its cost figures."""
    out, kept, cost = {}, None, {}
    for name in ("none", "fp16", "int8", "int4"):
        run = make_run(name)
        workers = collaborate(run, PEERS, rounds=rounds)
        rec = recompute.Recomputer(run, "cpu", micro_batch=7)
        errors, pairs, seconds, samples = [], [], 0.0, 0
        for r in range(rounds):
            entries = Close.read(run, r).accepted
            for e in entries:
                t0 = time.perf_counter()
                c = recompute.compare(recompute.read_shard(run, e), rec.gradient(e))
                seconds += time.perf_counter() - t0
                samples += e.samples
                errors.append((1 - c.cosine, abs(c.norm_ratio - 1)))
            cos = recompute.similarities(run, entries)
            pairs += [float(cos[i, j]) for i, j in _cross(entries)]
        tol = recompute.TOLERANCES[name]
        out[name] = {"shards": len(errors), "worst_1_minus_cosine": max(e[0] for e in errors),
                     "worst_norm_error": max(e[1] for e in errors), "max_honest_pair_cosine": max(pairs),
                     "tolerance": {"1_minus_cosine": 1 - tol.min_cosine, "norm_error": tol.max_norm_error},
                     "all_pass": all(e[0] <= 1 - tol.min_cosine and e[1] <= tol.max_norm_error for e in errors)}
        if name == "int8":
            kept = run
            cost = {"worker_s_per_sample": sum(w.compute_s for w in workers) / sum(w.computed_samples for w in workers),
                    "recompute_s_per_sample": seconds / samples}
    return out, kept, cost


def _cross(entries):
    return [(i, j) for i in range(len(entries)) for j in range(i + 1, len(entries))
            if volunteer_of(entries[i].peer) != volunteer_of(entries[j].peer)]


def _entry(r: int, stream: str, start: int, count: int) -> Entry:
    return Entry.model_construct(round=r, samples=count, stale_samples=0,
                                 data=DataRef(stream=stream, ranges=[(start, count)]))


def _int8(g: np.ndarray, run) -> np.ndarray:
    """What the validator decodes of a gradient the attacker encodes (no error feedback)."""
    b = run.config.block_size
    return codec.decode(codec.encode(g, "int8", b), "int8", b)


def detection(run, trials: int, rounds: int) -> dict:
    """Per attack: the share of trials the validator's comparison flags. Each trial takes a random
    committed state and a random place in a fresh stream; the claim is recomputed honestly."""
    rng = np.random.default_rng(0)
    rec = recompute.Recomputer(run, "cpu")
    tol = recompute.TOLERANCES["int8"]
    caught: dict[str, list[bool]] = {}
    seen: dict[str, list[tuple[float, float]]] = {}
    screened: list[bool] = []
    for t in range(trials):
        r, start = int(rng.integers(0, rounds)), int(rng.integers(0, 10_000))
        stream, other = f"mallory-{t}", f"victim-{t}"
        honest8 = rec.gradient(_entry(r, stream, start, 8))
        claim64 = rec.gradient(_entry(r, stream, start, 64))
        victim = rec.gradient(_entry(r, other, start, 8))
        attacks = {
            "honest (control)": (_int8(honest8, run), honest8),
            "inflated: 8 computed, 64 claimed": (_int8(honest8, run), claim64),
            "inflated: 56 computed, 64 claimed": (_int8(rec.gradient(_entry(r, stream, start, 56)), run), claim64),
            "wrong data": (_int8(rec.gradient(_entry(r, stream, start + 50_000, 8)), run), honest8),
            "scaled x2": (_int8(2 * honest8, run), honest8),
            "scaled x1.1": (_int8(1.1 * honest8, run), honest8),
            "scaled x1.03": (_int8(1.03 * honest8, run), honest8),
            "copied (another volunteer's shard)": (_int8(victim, run), honest8),
            "random noise (honest norm)": (
                _int8(rng.normal(0, 1, run.flat.n).astype(np.float32)
                      * np.float32(np.linalg.norm(honest8) / np.sqrt(run.flat.n)), run), honest8),
        }
        for name, (sent, claimed) in attacks.items():
            c = recompute.compare(sent, claimed)
            caught.setdefault(name, []).append(not c.matches(tol))
            seen.setdefault(name, []).append((c.cosine, c.norm_ratio))
        screened.append(recompute.compare(_int8(victim, run), victim).cosine >= recompute.COPY_COSINE)
    rates = {k: float(np.mean(v)) for k, v in caught.items()}
    medians = {k: {"cosine": float(np.median([c for c, _ in v])), "norm_ratio": float(np.median([n for _, n in v]))}
               for k, v in seen.items()}
    return {"trials": trials, "detected_when_chosen": rates, "median": medians,
            "copy_screen_detection": float(np.mean(screened))}


def draw_probability(n_shards: int, fraction: float = verify.FRACTION, samples: int = 20_000) -> float:
    """P(a given shard is recomputed) in a round of n shards: over random COMMIT hashes."""
    hits = 0
    keys = [Entry.model_construct(key=f"shard-{i}") for i in range(n_shards)]
    for s in range(samples):
        h = hashlib.sha256(str(s).encode()).hexdigest()
        hits += any(x.key == "shard-0" for x in verify.chosen(keys, h, fraction))
    return hits / samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--trials", type=int, default=20)
    a = p.parse_args()
    t0 = time.time()
    tol, run, cost = tolerances(a.rounds)
    det = detection(run, a.trials, a.rounds)
    draw = {n: draw_probability(n, samples=4000) for n in (3, 20, 100, 400)}
    rounds_to_flag = {
        str(n): {k: (1 / (pn * d) if d > 0 else None) for k, d in det["detected_when_chosen"].items()
                 if k != "honest (control)"} for n, pn in draw.items()}
    ratio = cost["recompute_s_per_sample"] / cost["worker_s_per_sample"]
    share = {str(n): ratio * pn for n, pn in draw.items()}  # equal shards: E[recomputed samples] / round samples
    print(json.dumps({"tolerances": tol, "detection": det, "p_drawn": {str(k): v for k, v in draw.items()},
                      "rounds_until_flagged": rounds_to_flag,
                      "cost": dict(cost, recompute_over_worker=ratio, validator_share_of_round=share),
                      "seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
