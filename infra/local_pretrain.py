"""`make pretrain`: a whole collaboration on this machine through the Prefect deployment.

Starts (or reuses) the local Prefect server, serves the flows, runs ``tokenize``, triggers
``pretrain`` on the bucket, starts local volunteer workers, waits for the flow run, runs
``evaluate``, prints a summary, and shuts everything it started down, also on Ctrl-C. The run
is a signed one, as a public run would be: an organizer key and a key per local volunteer in
``.dedloc/keys/``, the volunteers enrolled in the run's roster (docs/organizer.md, "Signed runs").
Settings come from the environment (the Makefile's variables; MAX_DOCS caps the corpus,
EVAL_EPOCHS and EVAL_TRAIN the fine-tuning, for quick runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "infra"))

import prefect_local  # noqa: E402

BIN = Path(sys.executable).parent


def env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def key(path: Path):
    from dedloc_pipeline.trust import identity
    return identity.load(path) if path.exists() else identity.generate(path)


def server_up(port: int) -> None:
    """The Prefect server this run uses still answers; else say so at once, not after a timeout."""
    if not prefect_local.healthy(port):
        raise RuntimeError(f"the Prefect server on port {port} went away (stopped, or killed); start "
                           "`make pretrain` again")


def wait_for(what: str, check, timeout: float, procs=(), port: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if port is not None:
            server_up(port)
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[1] if len(p.args) > 1 else p.args[0]} exited ({p.returncode}) "
                                   f"while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(0.5)


async def _deployment_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    async with get_client() as c:
        try:
            await c.read_deployment_by_name(name)
            return True
        except Exception:
            return False


async def _state(flow_run_id):
    from prefect.client.orchestration import get_client
    async with get_client() as c:
        return (await c.read_flow_run(flow_run_id)).state


def _finetune_options(seq_len: int) -> dict:
    """EVAL_EPOCHS and EVAL_TRAIN (training examples per task) set the fine-tuning's length; its
    sequences are the pretraining's (the stand-ins' texts are short)."""
    opts = {"epochs": int(env("EVAL_EPOCHS", "2")), "seq_len": seq_len}
    if env("EVAL_TRAIN", ""):
        opts["max_train"] = int(env("EVAL_TRAIN", ""))
    return opts


def _fifths(losses: list[float]) -> str:
    """The training loss as the mean of each fifth of the rounds: one round's loss is noisy."""
    k = max(1, len(losses) // 5)
    parts = [losses[i:i + k] for i in range(0, len(losses), k)][:5]
    return " -> ".join(f"{sum(p) / len(p):.3f}" for p in parts)


def _in_plain_words(result: dict, downstream: dict, workers: int, minutes: float) -> str:
    """What the run achieved, said plainly, and what a longer or GPU run would add."""
    drop, entropy = result["random_init_loss"] - result["loss"], result.get("unigram_entropy")
    who = f"{workers} volunteer{'s' if workers > 1 else ''} on this machine"
    if drop <= 0:
        return (f"In plain words: in {minutes:.0f} minutes {who} did not move the model below random init; "
                "the worker logs say why.")
    what = (f"{who} trained the model {drop:.2f} nats below random init in {minutes:.0f} minutes of pretraining"
            + (": it now predicts masked Bengali tokens from their context, not only from how common they are."
               if entropy is not None and result["loss"] < entropy else
               ", though not yet below the unigram entropy (it mostly knows how common each token is)."))
    better = [t for t, e in downstream.items() if e["pretrained"] > e["random_init"]]
    then = ("Fine-tuning from it already beats random init on " + " and ".join(better) + "." if better else
            "Fine-tuning from it does not beat random init yet: that takes far more pretraining.")
    return (f"In plain words: {what} {then} A longer run (`make quality`, about an hour here) or GPU volunteers "
            "take the loss far below the unigram entropy, where the encoder starts to pay off downstream; "
            "sahajBERT took dozens of volunteers' GPUs over days.")


def main() -> int:
    bucket = env("BUCKET", f"file://{ROOT}/.dedloc/bucket")
    run, rounds, workers = env("RUN", "demo"), int(env("ROUNDS", "120")), int(env("WORKERS", "2"))
    preset, target = env("PRESET", "tiny"), int(env("TARGET", "128"))
    data, seq_len = env("DATA", "bengali"), int(env("SEQ", "64"))
    from dedloc_pipeline.model.presets import PRESETS
    # tiny learns context fastest per CPU second from a 2000-token vocabulary (docs/first-run.md)
    vocab = int(env("VOCAB", "2000" if preset == "tiny" else str(PRESETS[preset]["vocab_size"])))
    port, home = int(env("PREFECT_PORT", "4200")), env("DEDLOC_PREFECT_HOME", str(ROOT / ".dedloc/prefect"))
    logs = Path(env("LOGS", str(ROOT / ".dedloc/logs")))
    logs.mkdir(parents=True, exist_ok=True)
    os.environ.update(prefect_local.settings(home, port))
    started_server = False
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        started_server = prefect_local.start(home, port, ui=env("PREFECT_UI", "1") == "1")
        print(f"Prefect server on http://127.0.0.1:{port} (home {home}"
              f"{'' if started_server else ', already running'})", flush=True)
        keys = ROOT / ".dedloc/keys"
        organizer = key(keys / "organizer.pem")
        # the served flows sign the run's records (CLOSE, COMMIT, LATEST, streams) with it
        os.environ["DEDLOC_ORGANIZER_KEY"] = str(keys / "organizer.pem")
        serve = subprocess.Popen([sys.executable, "-m", "flows.serve"], cwd=ROOT,
                                 stdout=open(logs / "serve.log", "ab"), stderr=subprocess.STDOUT)
        procs.append(serve)
        for name in ("tokenize/local", "pretrain/local", "evaluate/local"):
            wait_for(f"deployment {name}", lambda n=name: asyncio.run(_deployment_exists(n)), 120, procs)

        from prefect.deployments import run_deployment

        from dedloc_pipeline.protocol.run import Run
        from dedloc_pipeline.storage.bucket import Bucket
        from dedloc_pipeline.trust import identity

        print(f"tokenize: data set {data!r} (a {vocab}-token tokenizer, sentence-order pairs of {seq_len} tokens)",
              flush=True)
        fr = run_deployment("tokenize/local", parameters={
            "bucket": bucket, "data": data, "vocab_size": vocab, "seq_len": seq_len,
            "corpus_dir": str(ROOT / ".dedloc/corpus"), "max_documents": int(env("MAX_DOCS", "0")) or None},
            timeout=1800, poll_interval=1, as_subflow=False)
        if not fr.state.is_completed():
            raise RuntimeError(f"tokenize flow ended {fr.state.name}")
        # about ten states kept whole for the learning curve (the evaluation scores each)
        config = {"preset": preset, "target_batch_size": target, "data": data, "seq_len": seq_len,
                  "checkpoint_every": max(1, rounds // 10), "organizer_key": identity.public(organizer)}
        fr = run_deployment("pretrain/local", parameters={"bucket": bucket, "run": run, "rounds": rounds,
                                                          "config": config},
                            timeout=0, as_subflow=False)
        print(f"pretrain flow run {fr.name} ({fr.id}) triggered: {rounds} rounds, target batch {target}",
              flush=True)
        b = Bucket(bucket)
        wait_for(f"run {run} in {bucket}", lambda: b.exists(f"runs/{run}/state/LATEST.json"), 300, procs, port)
        peers = {f"local-{i}": keys / f"local-{i}.pem" for i in range(1, workers + 1)}
        roster = identity.update_roster(b, run, organizer,
                                        enroll={p: identity.public(key(k)) for p, k in peers.items()})
        for i, (peer, path) in enumerate(peers.items(), 1):
            procs.append(subprocess.Popen(
                [str(BIN / "dedloc"), "worker", "--bucket", bucket, "--run", run, "--peer-id", peer,
                 "--key", str(path), "--threads", "1", "--until-round", str(rounds)],
                stdout=open(logs / f"worker-{i}.log", "ab"), stderr=subprocess.STDOUT))
        print(f"{workers} volunteer workers started, enrolled in the run's signed roster (version "
              f"{roster.version}; keys in {keys}, logs in {logs})", flush=True)
        r = Run(b, run)
        started = time.monotonic()
        last = -1
        while True:
            server_up(port)
            state = asyncio.run(_state(fr.id))
            now = r.latest()
            if now != last:
                c = r.commit_of(now)
                loss = f"loss {c['loss']:.4f}" if c.get("loss") is not None else "initial state"
                print(f"  state {now}/{rounds}: {loss}", flush=True)
                last = now
            if state.is_final():
                break
            time.sleep(2)
        if not state.is_completed():
            raise RuntimeError(f"pretrain flow run ended {state.name}; see the Prefect UI")
        minutes = (time.monotonic() - started) / 60
        print(f"evaluate: held-out loss of the kept states, fine-tuning at state {rounds} (ALBERTs), each "
              "next to random init", flush=True)
        ev = run_deployment("evaluate/local", parameters={"bucket": bucket, "run": run, "curve": True,
                                                          "corpus_dir": str(ROOT / ".dedloc/corpus"),
                                                          "finetune_options": _finetune_options(seq_len)},
                            timeout=3600, poll_interval=1, as_subflow=False)
        if not ev.state.is_completed():
            raise RuntimeError(f"evaluate flow ended {ev.state.name}")
        from dedloc_pipeline.evaluation.heldout import task_of
        from dedloc_pipeline.monitoring import plots
        evals = {name[:-5]: b.read_json(f"runs/{run}/evals/{rounds:08d}/{name}")
                 for name in b.list(f"runs/{run}/evals/{rounds:08d}")}
        result = evals[task_of(r)]  # the held-out loss: masked-LM, or next-token for a causal preset
        curve = [(s, b.read_json(r.keys.eval(s, task_of(r)))["loss"]) for s in r.kept_states()]
        hist = [r.commit_of(s) for s in range(1, r.latest() + 1)]
        samples = sum(h["samples"] for h in hist)
        peers = sorted({p for h in hist for p in h["contributors"]})
        png = logs / "learning.png"
        png.write_bytes(plots.learning(hist, curve, result.get("unigram_entropy")))
        downstream = {t: {"source": e["source"], "metric": e["metric"], "pretrained": e["pretrained"]["test"],
                          "random_init": e["random_init"]["test"]}
                      for t, e in sorted(evals.items()) if "pretrained" in e}
        print("\n".join([
            "", f"run {run}: {len(hist)} rounds in {minutes:.1f} minutes, {samples} samples from {len(peers)} "
                f"volunteers ({', '.join(peers)})",
            f"  training loss (masked LM + sentence order), mean of each fifth of the rounds: "
            f"{_fifths([h['loss'] for h in hist])}",
            f"  held-out MLM loss: {result['random_init_loss']:.4f} at random init -> {result['loss']:.4f} at state "
            f"{result['state']} ({result['loss'] - result['random_init_loss']:+.2f} nats"
            + (f"; unigram entropy {result['unigram_entropy']:.4f}: below it the model uses context)"
               if result.get("unigram_entropy") else ")"),
            *[f"  {t} ({e['source']}): test {e['metric']} {e['pretrained']:.4f} (random init {e['random_init']:.4f})"
              for t, e in downstream.items()],
            f"  learning curve: {png}",
            f"  bucket: {bucket}/runs/{run}   evaluation: {bucket}/runs/{run}/evals/",
            f"  Prefect UI: http://127.0.0.1:{port} (flow runs, round tables, progress) "
            + ("is still up: `make stop` ends it" if not started_server or env("KEEP_SERVER", "0") == "1"
               else "closes now; KEEP_SERVER=1 keeps it up"),
            _in_plain_words(result, downstream, len(peers), minutes)]))
        print(json.dumps({"rounds": len(hist), "samples": samples, "minutes": minutes, "first_loss": hist[0]["loss"],
                          "last_loss": hist[-1]["loss"], "eval": result, "curve": curve, "png": str(png),
                          "downstream": downstream}), file=open(logs / "summary.json", "w"))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping workers and the deployment", file=sys.stderr)
        return 130
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        if started_server and env("KEEP_SERVER", "0") != "1":
            prefect_local.stop(home)


if __name__ == "__main__":
    sys.exit(main())
