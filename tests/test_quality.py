"""The quality benchmark's one-process pretraining (benchmarks/quality.py): where nothing separates
it from the collaboration (the exact codec, no delayed updates), it lands on the collaboration's
own states. So what the benchmark reports between the two is the protocol's approximations
(int8 shards, int4 deltas, one-step-stale samples), not a different training."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.quality import one_process
from dedloc_pipeline.testing import collaborate


@pytest.mark.slow
def test_one_process_at_the_same_samples_is_the_collaboration_without_its_approximations(make_run):
    run = make_run(codec="none", delayed_updates=False, optimizer={"name": "adamw", "lr": 3e-3, "warmup_steps": 2})
    collaborate(run, [("a", 4), ("b", 3), ("c", 5)], rounds=3)
    solo = one_process(run, [1, 3], threads=1, micro_batch=5)
    assert sorted(solo) == [0, 1, 3]
    for s in (1, 3):
        got = run.load_params(s)
        assert np.abs(got - solo[s]).max() <= 1e-5, s
        assert np.abs(got - solo[0]).max() > 1e-4  # training moved the weights
    # the control: with delayed updates, stale samples make the collaboration another training
    stale = make_run(run="stale", codec="none", delayed_updates=True,
                     optimizer={"name": "adamw", "lr": 3e-3, "warmup_steps": 2})
    collaborate(stale, [("a", 4), ("b", 3), ("c", 5)], rounds=3)
    assert any(s["stale_samples"] for r in range(3) for s in stale.bucket.read_json(stale.keys.close(r))["accepted"])
    assert np.abs(stale.load_params(3) - one_process(stale, [3], threads=1)[3]).max() > 1e-4


def test_the_figure_without_fine_tuning_has_the_curve_alone():
    """The GPU run (benchmarks/gpu_quality.sh) fine-tunes nothing and has no reference."""
    from benchmarks.quality import figure
    res = {"curve": {"samples": [0, 128], "collaboration": [6.0, 5.9]}, "peers": 2, "unigram_entropy": 6.1,
           "downstream": {}}
    assert figure(res)[:8] == b"\x89PNG\r\n\x1a\n"
