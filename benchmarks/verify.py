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
4. The local-steps mode (``algorithm: diloco``, ``inner_state: shard``). Per codec and
   precision, one real collaboration per attack: three honest volunteers and mallory, who
   cheats in every shard (``cheat``), delayed updates (stale shards, the workers' error
   feedback). Every shard each volunteer wrote, accepted by the scheduler's screens or not, is
   replayed by ``Recomputer`` with another micro-batch than the worker's and judged against
   ``recompute.tolerance``: the worst honest errors, the share of mallory's shards caught, and
   replay seconds per sample against the volunteers' (inner steps included); with a
   tolerance's ``pair_cosine`` (sparse), also the share ``Tolerance.short_of`` the round's
   least matching honest shard (the reference least in the attacker's disfavour), and the
   rounds whose least matching honest shard is short of the best one. And scored by the
   loss screen before CLOSE (``probe.LossProbe``, ``close.probe_samples`` of its samples): the
   honest shards' lowest score, each attack's share under ``close.min_descent`` and its median
   score, and the screen's seconds per shard. And the validator's copy screen alone (nothing
   drawn): the share of mallory's accepted shards it calls copies, honest shards it does, and
   (sparse) the overlap of kept positions between honest volunteers' shards.

``python -m benchmarks.verify [--rounds 4] [--trials 20] [--diloco-rounds 6]`` prints a JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time

import numpy as np

from dedloc_pipeline.checks import admission, recompute, verify
from dedloc_pipeline.checks.probe import LossProbe
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.protocol.shard import DataRef, Entry, Manifest
from dedloc_pipeline.storage import codec
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import volunteer_of
from dedloc_pipeline.testing import TINY, LockStep, collaborate, small_config
from dedloc_pipeline.volunteer.worker import Worker

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
            cos = recompute.similarities(run, entries).cosine
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


DILOCO_CASES = (("none", "fp32"), ("int8", "fp32"), ("int8", "bf16"), ("sparse", "fp32"))
ATTACKS = ("honest", "reversed", "scaled", "noise", "copied", "disguised", "poisoned")
POISON_OFFSET = 50_000  # poisoned: trains on its stream's samples this far past those it claims


def cheat(w: Worker, attack: str, victim: Worker) -> None:
    """Volunteer ``w`` cheats in every shard as ``attack`` says: its pseudo-gradient reversed,
    scaled x8, replaced by gaussian noise of its norm or by ``victim``'s latest one (copied);
    its upload replaced by ``victim``'s latest, each block scaled by its own random factor in
    [1/e, e] (disguised: other values, the same positions); or its inner steps trained on other
    samples of its stream than it claims (poisoned)."""
    honest = w.local.update
    if attack == "disguised":
        theirs, mine, latest = victim.transfers.feedback, w.transfers.feedback, {}
        encode, own, rng = theirs.encode, mine.encode, np.random.default_rng(0)

        def victims(update: np.ndarray):
            latest["arrays"] = encode(update)
            return latest["arrays"]

        def disguised(update: np.ndarray):
            if not latest:
                return own(update)
            cfg = w.run.config
            x = codec.decode(latest["arrays"], cfg.codec, cfg.block_size, update.size)
            x *= np.repeat(np.exp(rng.uniform(-1, 1, -(-x.size // cfg.block_size))), cfg.block_size)[: x.size]
            return codec.encode(x.astype(np.float32), cfg.codec, cfg.block_size)
        theirs.encode, mine.encode = victims, disguised
    elif attack == "poisoned":
        train = w.train
        w.train = lambda cursor, n: train(cursor + POISON_OFFSET, n)
    elif attack == "copied":
        theirs, latest = victim.local.update, {}

        def victims(state: int) -> np.ndarray:
            latest["p"] = theirs(state)
            return latest["p"].copy()  # its own upload's error feedback works on its copy

        def copied(state: int) -> np.ndarray:
            own = honest(state)  # its own inner steps, thrown away
            return latest["p"].copy() if latest else own
        victim.local.update, w.local.update = victims, copied
    elif attack != "honest":
        rng = np.random.default_rng(0)
        w.local.update = {
            "reversed": lambda state: -honest(state),
            "scaled": lambda state: 8 * honest(state),
            "noise": lambda state: _noise(honest(state), rng),
        }[attack]


def _noise(p: np.ndarray, rng) -> np.ndarray:
    return (rng.normal(0, 1, p.size) * (np.linalg.norm(p) / np.sqrt(p.size))).astype(np.float32)


def diloco_run(codec_name: str, precision: str, attack: str, rounds: int, size: dict = TINY, bucket=None,
               **config) -> tuple[object, dict[str, Worker], list[Entry]]:
    """A lock-step local-steps collaboration of the ``size`` model (the tests': ``{}``, micro) in
    which ``mallory`` cheats as ``attack`` says, to state ``rounds``: its run, its workers and
    every shard they wrote, as the validator judges one. A target of 40 samples makes steps
    shorter than ``inner_batch`` and steps across the stale boundary."""
    cfg = small_config("bench", **{**size, "codec": codec_name, "delayed_updates": True, "keep_states": 100,
                                   "algorithm": "diloco", "inner_batch": 8, "target_batch_size": 40,
                                   "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2}, **config})
    run = init_run(bucket or Bucket(tempfile.mkdtemp(prefix="verify-bench-")), cfg)
    peers = PEERS + [("mallory", 4)]
    manifests: dict[str, bytes] = {}
    with LockStep(run) as c:
        for name, mb in peers:
            c.workers[name] = Worker(run, name, micro_batch=mb, threads=1, poll_s=0, precision=precision)
        cheat(c.workers["mallory"], attack, c.workers[peers[0][0]])
        while run.latest() < rounds:
            c.tick()  # read as they land: a commit prunes the volunteers' manifests of closed rounds
            manifests.update({k: run.bucket.read_bytes(run.keys.manifest(k))
                              for w in c.workers.values() for _, k, _ in w.uploads if k not in manifests})
    return run, c.workers, [entry_of(k, raw) for k, raw in manifests.items()]


def entry_of(key: str, raw: bytes) -> Entry:
    """A shard's manifest as the validator reads its CLOSE entry (its frozen copy, checksums and
    claims), whether the scheduler accepted it or not."""
    m = Manifest.model_validate_json(raw)
    return Entry(key=key, norm=0.0, manifest_sha="", **m.model_dump(
        include={"peer", "part", "round", "samples", "loss", "stale_samples", "inner_steps", "precision",
                 "checksums", "data"}))


def diloco(rounds: int, cases: tuple = DILOCO_CASES) -> dict:
    """Per case (codec/precision): the worst honest shards, and per attack the share of
    mallory's shards caught and their median comparison; the replay's cost."""
    out = {}
    for codec_name, precision in cases:
        honest, attacks, replay_s, replay_n, worker_s, worker_n, shards = [], {}, 0.0, 0, 0.0, 0, 0
        honest_z, probe_s, probe_n, honest_copies, overlaps, spread = [], 0.0, 0, 0, [], 0
        honest_over = []  # a shard's norm over its round's median volunteer's, as the norm screen compares them
        apart = []  # per round, how many times as far from 1 its least matching honest shard is as its best
        for attack in ATTACKS:
            run, workers, entries = diloco_run(codec_name, precision, attack, rounds)
            rec = recompute.Recomputer(run, "cpu", micro_batch=7)
            tol = recompute.tolerance(run.config, precision)
            probe, least = LossProbe(run, run.config.close.probe_samples), run.config.close.min_descent
            mine, scores, rounds_honest = [], [], {}  # per round, the honest shards' cosines
            norms: dict[int, list[Entry]] = {}  # per round, every shard with its norm
            for e in entries:
                try:
                    sent = recompute.read_shard(run, e)
                except recompute.Unverifiable:  # never judged (late, or refused before its copy was made)
                    continue
                t0 = time.perf_counter()
                replayed = rec.gradient(e)
                replay_s, replay_n, shards = replay_s + time.perf_counter() - t0, replay_n + e.samples, shards + 1
                c = tol.compare(sent, replayed)
                norms.setdefault(e.round, []).append(e.model_copy(update={"norm": float(np.linalg.norm(sent))}))
                t0 = time.perf_counter()
                z = probe.descent(e, sent)
                probe_s, probe_n = probe_s + time.perf_counter() - t0, probe_n + 1
                if e.peer == "mallory" and attack != "honest":
                    mine.append((e.round, c))
                    scores.append(z)
                else:
                    honest.append(c)
                    honest_z.append(z)
                    rounds_honest.setdefault(e.round, []).append(c.cosine)
            worst = {r: min(cs) for r, cs in rounds_honest.items()}
            over = []  # (mallory's?, its screened norm over the median volunteer's), rounds of 3 volunteers or more
            for es in norms.values():
                scaled, median = admission.screened_norms(es)
                over += [(e.peer == "mallory", scaled[e.key] / median) for e in es if e.key in scaled]
            honest_over += [x for m, x in over if not m or attack == "honest"]
            spread += sum(tol.short_of(min(cs), max(cs)) for cs in rounds_honest.values())
            apart += [(1 - min(cs)) / max(1 - max(cs), 1e-12) for cs in rounds_honest.values()
                      if tol.pair_cosine is not None and min(cs) < tol.pair_cosine]  # where short_of may apply
            screened = _copy_screen(run, rounds)
            honest_copies += sum(s["verdict"] == "copy" for s in screened["shards"] if s["peer"] != "mallory")
            overlaps += screened["honest_overlaps"] if attack == "honest" else []
            worker_s += sum(w.compute_s for w in workers.values())
            worker_n += sum(w.computed_samples for w in workers.values())
            if attack != "honest":
                paired = [not c.matches(tol) or tol.short_of(c.cosine, worst[r]) for r, c in mine if r in worst]
                attacks[attack] = {"shards": len(mine),
                                   "detected": float(np.mean([not c.matches(tol) for _, c in mine])),
                                   "detected_beside_reference": float(np.mean(paired)),
                                   "median_cosine": float(np.median([c.cosine for _, c in mine])),
                                   "max_cosine": float(max(c.cosine for _, c in mine)),
                                   "median_norm_ratio": float(np.median([c.norm_ratio for _, c in mine])),
                                   "loss_screen_refused": float(np.mean([z < least for z in scores])),
                                   "loss_screen_median": float(np.median(scores)),
                                   "copy_screen_flagged": screened["mallory_copies"],
                                   "median_norm_over_round": float(np.median([x for m, x in over if m])),
                                   "least_times_as_far": min((1 - c.cosine) / max(1 - worst[r], 1e-12)
                                                             for r, c in mine if r in worst)}
        out[f"{codec_name}/{precision}"] = {
            "tolerance": {"1_minus_cosine": 1 - tol.min_cosine, "norm_error": tol.max_norm_error,
                          "kept_only": tol.kept_only},
            "honest": {"shards": len(honest), "worst_1_minus_cosine": max(1 - c.cosine for c in honest),
                       "worst_norm_error": max(abs(c.norm_ratio - 1) for c in honest),
                       "min_cosine": min(c.cosine for c in honest),
                       "norm_ratios": [min(c.norm_ratio for c in honest), max(c.norm_ratio for c in honest)],
                       "false_flags": sum(not c.matches(tol) for c in honest),
                       "rounds_short_of_another": spread, "most_times_as_far": max(apart, default=None),
                       "loss_screen_min": min(honest_z), "loss_screen_refused": sum(z < least for z in honest_z),
                       "copy_screen_flagged": honest_copies,
                       "max_norm_over_round": max(honest_over, default=None),
                       "max_pair_overlap": max(overlaps, default=None), "median_pair_overlap":
                           float(np.median(overlaps)) if overlaps else None},
            "attacks": attacks,
            "cost": {"replay_s_per_shard": replay_s / shards, "samples_per_shard": replay_n / shards,
                     "volunteer_s_per_shard": worker_s / worker_n * replay_n / shards,
                     "replay_s_per_sample": replay_s / replay_n, "worker_s_per_sample": worker_s / worker_n,
                     "replay_over_worker": (replay_s / replay_n) / (worker_s / worker_n),
                     "loss_screen_s_per_shard": probe_s / probe_n}}
    return out


def _copy_screen(run, rounds: int) -> dict:
    """The validator's copy screen alone (nothing drawn) over every round: the share of
    mallory's accepted shards it calls copies, every verdict it gave, and the kept-position
    overlaps of honest pairs (sparse: from the honest run)."""
    verify.Verifier(run, fraction=0.0, at_least=0, device="cpu").serve(until_round=rounds - 1)
    shards, mine, overlaps = [], 0, []
    for r in range(rounds):
        record = run.bucket.read_json(run.keys.verdicts(r))
        shards += record["shards"]
        entries = Close.read(run, r).accepted
        mine += sum(e.peer == "mallory" for e in entries)
        pairs = recompute.similarities(run, entries)
        if pairs.overlap is not None:
            overlaps += [float(pairs.overlap[i, j]) for i, j in _cross(entries)
                         if "mallory" not in (entries[i].peer, entries[j].peer)]
    copies = sum(s["verdict"] == "copy" for s in shards if s["peer"] == "mallory")
    return {"shards": shards, "mallory_copies": copies / mine if mine else None, "honest_overlaps": overlaps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--diloco-rounds", type=int, default=6)
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
                      "diloco": diloco(a.diloco_rounds), "seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
