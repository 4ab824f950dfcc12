"""The aggregators' reduction and step are bitwise reproducible (docs/design.md, "Bitwise
reproducible aggregation"): the same inputs give the same bytes in another process, on one thread
or two, with numpy's and torch's machine-dependent kernels turned off (as a CPU without AVX2 or
AVX-512 would run them), for the codecs ``none``, ``int8`` and ``sparse``, the robust aggregations
and LAMB's two passes, and so are the checks of each part of the shards (``part_checks``). Two
aggregators' answers can then be compared bit for bit.

The controls show that the environments really differ where code is machine-dependent: torch's
AdamW, and numpy's selection among ties, give other bits there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dedloc_pipeline.compute import aggregation
from dedloc_pipeline.protocol.close import round_close
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import collaborate, small_config

pytestmark = pytest.mark.slow

# A machine without AVX2 and AVX-512, as far as numpy and torch can tell, on one thread
PLAIN_CPU = {"NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL", "ATEN_CPU_CAPABILITY": "default",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "BLOSC_NTHREADS": "1"}
WIDE_CPU = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "BLOSC_NTHREADS": "2"}

CASES = {
    "none, adamw": dict(codec="none"),
    "int8, lamb": dict(codec="int8", optimizer={"name": "lamb", "lr": 5e-3}),
    "int8, centered_clip": dict(codec="int8", aggregation="centered_clip", norm_screen=None),
    "int8, trimmed_mean": dict(codec="int8", aggregation="trimmed_mean", norm_screen=None),
    "sparse, diloco": dict(codec="sparse", algorithm="diloco", inner_batch=8,
                           optimizer={"name": "adamw", "lr": 3e-3}),
}

# In another process: every part of round 1 of each run, reduced and stepped, written under out/
# as the scheduler writes state 2 (LAMB's partial sums of every part merged first).
COMPUTE = """
import json, sys
from dedloc_pipeline.compute import aggregation, optim
from dedloc_pipeline.protocol.close import round_close
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket
out = {}
for root in sys.argv[1:]:
    run = Run(Bucket(f"file://{root}/bucket"), "test")
    grads = {k: aggregation.mean_gradient(run, 1, k) for k in range(run.n_parts)}
    norms, opt = None, run.config.aggregator_optimizer
    if opt.name == "lamb":
        norms = optim.merge_partials([s for k in range(run.n_parts)
                                      for s in aggregation.part_sums(run, 1, k, grads[k])])
    for k in range(run.n_parts):
        vectors = aggregation.next_part(run, 1, k, grads[k], norms)
        aggregation.write_part(Bucket(f"file://{root}"), "out", run, k, vectors)
    accepted = round_close(run, 1).accepted  # and each part's checks of the shards (checks/exchange.py)
    checks = [aggregation.part_checks(run, k, accepted, aggregation.read_part(run, accepted, k))
              for k in range(run.n_parts)]
    with open(f"{root}/checks.json", "w") as f:
        json.dump(checks, f)
    out[root] = True
print(json.dumps(out))
"""


def _compute(roots: list[Path], env: dict) -> None:
    done = subprocess.run([sys.executable, "-c", COMPUTE, *map(str, roots)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _objects(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Each case's run, to state 2 (round 1 reduced and applied by the scheduler in this process)."""
    out = {}
    for name, kw in CASES.items():
        root = tmp_path_factory.mktemp(name.replace(", ", "-"))
        run = init_run(Bucket(f"file://{root}/bucket"), small_config(keep_states=10, **kw))
        collaborate(run, [("a", 4), ("b", 3), ("c", 5), ("d", 2)], rounds=2)
        out[name] = (root, run)
    return out


def test_a_part_is_the_same_bytes_in_another_process_and_on_a_plain_cpu(runs):
    roots = [root for root, _ in runs.values()]
    _compute(roots, WIDE_CPU)
    wide = {root: _objects(root / "out") for root in roots}
    wide_checks = {root: (root / "checks.json").read_text() for root in roots}
    for root in roots:
        (root / "out").rename(root / "wide")
    _compute(roots, PLAIN_CPU)
    for name, (root, run) in runs.items():
        plain = _objects(root / "out")
        assert plain and plain == wide[root], f"{name}: another environment wrote other bytes"
        accepted = round_close(run, 1).accepted
        here = [aggregation.part_checks(run, k, accepted, aggregation.read_part(run, accepted, k))
                for k in range(run.n_parts)]
        assert json.loads(wide_checks[root]) == json.loads((root / "checks.json").read_text()) == here, name
        state = run.keys.state(2)
        committed = {k: v for k, v in _objects(root / "bucket" / state).items()
                     if not k.startswith(("applied", "COMMIT", "streams"))}
        assert plain == committed, f"{name}: the scheduler's own state 2 differs from another process's"


TORCH_ADAMW = """
import hashlib, numpy as np, torch
rng = np.random.default_rng(0)
w = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(100_003).astype(np.float32)))
w.grad = torch.from_numpy(rng.standard_normal(100_003).astype(np.float32))
opt = torch.optim.AdamW([w], lr=1e-3, foreach=False)
for _ in range(3):
    opt.step()
print(hashlib.sha256(w.detach().numpy().tobytes()).hexdigest())
"""

TIES = """
import hashlib, numpy as np
rng = np.random.default_rng(0)
x = np.abs(rng.standard_normal(4096 * 16).astype(np.float32)); x[rng.random(x.size) < 0.99] = 0
print(hashlib.sha256(np.sort(np.argpartition(x.reshape(16, 4096), 4096 - 64, axis=1)[:, -64:], axis=1)).hexdigest())
"""


@pytest.mark.parametrize("script", [TORCH_ADAMW, TIES], ids=["torch AdamW", "numpy selection among ties"])
def test_control_the_environments_differ_where_code_is_machine_dependent(script):
    """What the aggregation no longer uses gives other bits on the plain CPU: torch's AdamW
    (fused multiply-adds) and an argpartition among equal values (the sparse codec's keys are
    unique for this reason)."""
    got = [subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300, check=True).stdout for env in (WIDE_CPU, PLAIN_CPU)]
    assert got[0] != got[1]

