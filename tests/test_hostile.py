"""One malicious volunteer in four, throughout a signed multi-process run (issue 15).

Mallory is enrolled like everyone else and runs the real worker, changed in two ways: every
shard carries its honest gradient reversed at three times its length, and claims eight times
the samples it computed (its data references run on contiguously, as an honest peer's would).
The defended run (centered_clip, capped claims, the validator recomputing every shard) must end
within 10% of the held-out loss of the same run without mallory. The control is the same
attack on the plain mean without a validator: it keeps less than a third of what the honest run
learned (measured at 10 rounds: 9.02 and 9.44 from 9.03, the honest run 6.6-7.0).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dedloc_pipeline.evaluation.heldout import heldout_scores
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.trust import identity

from .test_e2e import RUN, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 12  # mallory's early rounds (before its flag) weigh less the longer the run: at 6 rounds one of two
# runs ended 11.5% off the honest one, at 10 rounds 2.4%, 5.6% and 7.1% (under CI's load)
HONEST = ("w0", "w1", "w2")
CLAIM = 8  # mallory claims this many times the samples it computed
MALLORY = r"""
import sys
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.protocol.worker import Worker
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.trust import identity

url, run_name, key, until, claim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
w = Worker(Run(Bucket(url), run_name), "mallory", micro_batch=4, threads=1, poll_s=0.3, signer=identity.load(key))
honest_sum = w.flat.grad
w.flat.grad = lambda: -3 * claim * honest_sum()  # after the worker divides by the claimed samples: -3x the mean
compute = w._compute


def inflated(round_):
    compute(round_)
    extra = (claim - 1) * w.micro_batch
    w.acc.samples += extra
    w.acc.ranges[-1][1] += extra
    w.cursor += extra


w._compute = inflated
w.serve(until)
"""


def _collaboration(tmp_path, name: str, keys, mallory: bool, *init: str, verify: bool = False) -> Run:
    c = Cluster(tmp_path / name, f"file://{tmp_path / name}/bucket")
    (tmp_path / name).mkdir()
    try:
        c.env["DEDLOC_ORGANIZER_KEY"] = str(keys["org"])
        c.init("--late-shards", "fold", "--organizer-key", str(keys["org"]), *init)
        for p in (*HONEST, "mallory"):
            c.cli("enroll", "--organizer-key", str(keys["org"]), "--volunteer", p,
                  "--public-key", identity.public(identity.load(keys[p])))
        c.scheduler(ROUNDS)
        if verify:
            c.start("verify", "verify", "--fraction", "1", "--until-round", str(ROUNDS - 1), "--poll", "0.5")
        for p in HONEST:
            c.worker(p, ROUNDS, "--key", str(keys[p]))
        if mallory:
            log = open(c.tmp / "mallory.log", "w")
            c._files.append(log)
            c.procs["mallory"] = subprocess.Popen(
                [sys.executable, "-c", MALLORY, c.url, RUN, str(keys["mallory"]), str(ROUNDS), str(CLAIM)],
                env=c.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        c.wait_exit(["scheduler", *HONEST], timeout=400)
        if verify:
            c.wait_exit(["verify"], timeout=200)
        return c.run
    finally:
        c.stop()


def _heldout(run: Run, state: int) -> float:
    return heldout_scores(run, run.load_params(state), 96)[0]


def test_one_malicious_volunteer_in_four_changes_the_loss_by_under_ten_percent(tmp_path):
    keys = {p: tmp_path / f"{p}.pem" for p in ("org", *HONEST, "mallory")}
    for path in keys.values():
        identity.generate(path)
    robust = ("--aggregation", "centered_clip")
    honest = _collaboration(tmp_path, "honest", keys, False, *robust)
    attacked = _collaboration(tmp_path, "attacked", keys, True, *robust, verify=True)
    control = _collaboration(tmp_path, "control", keys, True)
    start, h, a, u = (_heldout(honest, 0), _heldout(honest, ROUNDS), _heldout(attacked, ROUNDS),
                      _heldout(control, ROUNDS))
    assert h < start - 0.1, (start, h)
    assert abs(a - h) <= 0.1 * h, {"start": start, "honest": h, "attacked": a, "control": u}
    assert start - u < (start - h) / 3, {"start": start, "honest": h, "attacked": a, "control": u}  # undefended
    # mallory took part, was capped, and the validator caught it
    shards = [s for r in range(ROUNDS) for s in attacked.commit_of(r + 1)["shards"] if s["peer"] == "mallory"]
    assert shards and sum(s["weight"] for s in shards) < sum(s["samples"] for s in shards)
    flag = attacked.bucket.read_json(attacked.keys.flag("mallory"))
    assert flag is not None and flag["verdict"] == "mismatch", flag
    assert not any(attacked.bucket.exists(attacked.keys.flag(p)) for p in HONEST)
