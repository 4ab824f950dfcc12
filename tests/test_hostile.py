"""One malicious volunteer in four, throughout a signed run: with the default algorithm in one
process (issue 15), and in the local-steps mode in real processes (issue 26).

Mallory is enrolled like everyone else and runs the real worker, changed in two ways: every shard
carries its honest gradient reversed at three times its length (the lock-step driver's
``tamper``), and claims eight times the samples it computed (its ``train`` computes the first
eighth of each micro-batch it is given: its data references run on contiguously, as an honest
peer's would). The defended run (centered_clip, capped claims, the validator recomputing every
shard as each round commits) must end where the same run without mallory ends, within 2% of the
held-out loss. The control is the same attack on the plain mean without a validator: it keeps less
than a third of what the honest run learned. The driver is lock-step, so each run's losses are the
same on every machine whatever its load (measured at 6 rounds on the micro preset: held-out 7.57
at the start, honest 6.63, attacked 6.65, control 8.11; on tiny 9.03, 7.46, 7.50, 9.82). The real
processes, command line and signed roster of a signed run are `make pretrain`'s
(tests/test_deployment.py).
"""

from __future__ import annotations

import pytest

from dedloc_pipeline.evaluation.heldout import heldout_scores
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.protocol.verify import Verifier
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import LockStep, collaborate, small_config
from dedloc_pipeline.trust import identity

ROUNDS = 6
HONEST = ("w0", "w1", "w2")
CLAIM = 8  # mallory claims this many times the samples it computed
MICRO_BATCH = 4

# three runs of six signed rounds, one with every shard recomputed: minutes on two cores, so out of
# the fast tier, though it starts no process
pytestmark = pytest.mark.slow


def _collaboration(url: str, keys: dict, mallory: bool, aggregation: str = "mean", verify: bool = False) -> Run:
    org = keys["org"]
    cfg = small_config("hostile", target_batch_size=24, aggregation=aggregation, organizer_key=identity.public(org),
                       optimizer={"lr": 2e-3, "warmup_steps": 0}, close={"late_shards": "fold"})
    run = init_run(Bucket(url), cfg, organizer=org)
    enroll = {p: identity.public(keys[p]) for p in (*HONEST, "mallory")}
    identity.update_roster(run.bucket, run.name, org, enroll=enroll)
    validator = Verifier(run, fraction=1.0, device="cpu") if verify else None
    verified = 0
    with LockStep(run) as c:
        for p in HONEST:
            c.join(p, MICRO_BATCH, signer=keys[p])
        if mallory:
            # after the worker divides by the claimed samples: -3x the mean of what it computed
            w = c.join("mallory", CLAIM * MICRO_BATCH, signer=keys["mallory"], tamper=lambda g: -3 * CLAIM * g)
            w.train = lambda cursor, n, honest=w.train: honest(cursor, n // CLAIM)
        while run.latest() < ROUNDS:
            c.tick()
            while validator is not None and verified < run.latest():  # each round verified as it commits
                validator.verify_round(verified)
                verified += 1
    return run


def _heldout(run: Run, state: int) -> float:
    return heldout_scores(run, run.load_params(state), 96)[0]


def test_one_malicious_volunteer_in_four_changes_the_loss_by_under_two_percent(tmp_path):
    keys = {p: identity.generate(tmp_path / f"{p}.pem") for p in ("org", *HONEST, "mallory")}
    honest = _collaboration(f"file://{tmp_path}/honest", keys, False, "centered_clip")
    attacked = _collaboration(f"file://{tmp_path}/attacked", keys, True, "centered_clip", verify=True)
    control = _collaboration(f"file://{tmp_path}/control", keys, True)
    start, h, a, u = (_heldout(honest, 0), _heldout(honest, ROUNDS), _heldout(attacked, ROUNDS),
                      _heldout(control, ROUNDS))
    losses = {"start": start, "honest": h, "attacked": a, "control": u}
    assert h < start - 0.1, losses
    assert abs(a - h) <= 0.02 * h, losses
    assert start - u < (start - h) / 3, losses  # undefended
    # mallory took part, was capped, and the validator caught it at its first round
    commits = [attacked.commit_of(r + 1) for r in range(ROUNDS)]
    shards = [(x["round"], s) for x in commits for s in x["shards"] if s["peer"] == "mallory"]
    assert shards and sum(s["weight"] for _, s in shards) < sum(s["samples"] for _, s in shards)
    flag = attacked.bucket.read_json(attacked.keys.flag("mallory"))
    assert flag is not None and flag["verdict"] == "mismatch", flag
    assert {r for r, _ in shards} == {flag["round"]} == {0}  # none counted once it was flagged
    assert not any(attacked.bucket.exists(attacked.keys.flag(p)) for p in HONEST)


# the local-steps mode, in real processes: the direction screen as the defaults have it

MALLORY = """
import sys
from dedloc_pipeline.monitoring.volunteer import make_worker
url, run, key, organizer, until = sys.argv[1:]
w = make_worker(url, run, "mallory", key, "cpu", threads=1, poll=0.2, organizer=organizer)
honest = w.local.update
w.local.update = lambda state: -8 * honest(state)  # its pseudo-gradient reversed at 8x
w.serve(int(until))
w.leave()
"""
LOCAL_ROUNDS = 6
LOCAL_STEPS = dict(algorithm="diloco", codec="int8", inner_batch=8, target_batch_size=144,
                   optimizer={"name": "adamw", "lr": 3e-3, "warmup_steps": 2})


def _local_steps_run(tmp_path, keys: dict, mallory: bool, name: str) -> Run:
    """A signed local-steps run in real processes (`dedloc aggregate`, a `dedloc worker` per
    honest volunteer, mallory's modified worker) with the default aggregation and screens."""
    import os
    import subprocess
    import sys

    org = keys["org"]
    cfg = small_config(name, **LOCAL_STEPS, organizer_key=identity.public(org))
    url = f"file://{tmp_path}/{name}"
    run = init_run(Bucket(url), cfg, organizer=org)
    volunteers = (*HONEST, "mallory") if mallory else HONEST
    identity.update_roster(run.bucket, run.name, org, enroll={p: identity.public(keys[p]) for p in volunteers})
    dedloc = os.path.join(os.path.dirname(sys.executable), "dedloc")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    common = ["--bucket", url, "--run", name, "--until-round", str(LOCAL_ROUNDS)]
    pub, pem = identity.public(org), {p: str(tmp_path / f"{p}.pem") for p in keys}
    commands = [[dedloc, "aggregate", *common, "--organizer-key", pem["org"], "--poll", "0.5"]]
    commands += [[dedloc, "worker", *common, "--peer-id", p, "--key", pem[p], "--organizer", pub, "--threads", "1",
                  "--poll", "0.2", "--plain"] for p in HONEST]
    if mallory:
        commands.append([sys.executable, "-c", MALLORY, url, name, pem["mallory"], pub, str(LOCAL_ROUNDS)])
    logs = [open(tmp_path / f"{name}-{i}.log", "w") for i in range(len(commands))]
    procs = [subprocess.Popen(c, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
             for c, log in zip(commands, logs)]
    try:
        for p in procs:
            p.wait(timeout=420)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    tails = "\n".join((tmp_path / f"{name}-{i}.log").read_text()[-1500:] for i in range(len(commands)))
    assert [p.returncode for p in procs] == [0] * len(procs), tails
    return run


def test_one_reversed_volunteer_in_four_in_the_local_steps_mode_is_screened_out(tmp_path):
    """Signed, in real processes, with the default aggregation (the mean) and screens: mallory's
    pseudo-gradient, reversed at 8x, is refused (by the direction screen, or the norm screen when
    its length passes 10x) in most rounds, and the run ends within 3% of the honest run's
    held-out loss. Its control, in one process (lock step, so exact on every machine): the same
    attack with the screen off is counted and keeps less than a third of what the run learned."""
    keys = {p: identity.generate(tmp_path / f"{p}.pem") for p in ("org", *HONEST, "mallory")}
    honest = _local_steps_run(tmp_path, keys, False, "honest")
    attacked = _local_steps_run(tmp_path, keys, True, "attacked")
    start, h, a = _heldout(honest, 0), _heldout(honest, LOCAL_ROUNDS), _heldout(attacked, LOCAL_ROUNDS)
    losses = {"start": start, "honest": h, "attacked": a}
    assert h < start - 0.1, losses
    assert abs(a - h) <= 0.03 * h, losses
    # mallory sent a shard to every round and was refused in most (the screen is statistical: in
    # real processes an honest shard is refused now and then, and mallory counted, docs/diloco.md)
    closes = [attacked.read_record(attacked.keys.close(r), "CLOSE", round=r) for r in range(LOCAL_ROUNDS)]
    whose = attacked.keys.shard_parts
    refused = [r for r, c in enumerate(closes) if any(whose(x["key"])[1] == "mallory" for x in c["rejected"])]
    counted = [r for r, c in enumerate(closes) if any(s["peer"] == "mallory" for s in c["accepted"])]
    assert len(refused) > LOCAL_ROUNDS / 2 and len(counted) < LOCAL_ROUNDS / 2, (refused, counted)
    assert any("points away" in x["reason"] for c in closes for x in c["rejected"])
    # the control: the screen off, mallory counted, and the run keeps less than a third of what it learned
    control = init_run(Bucket(f"file://{tmp_path}/control"), small_config("control", **LOCAL_STEPS,
                                                                          close={"min_agreement": None}))
    collaborate(control, [(p, MICRO_BATCH) for p in (*HONEST, "mallory")], LOCAL_ROUNDS,
                tamper={"mallory": lambda g: -8 * g})
    u = _heldout(control, LOCAL_ROUNDS)
    assert start - u < (start - h) / 3, {**losses, "control": u}
