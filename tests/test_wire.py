"""The traffic claim behind benchmark 2, measured the way it is: each peer's own bucket counters."""

import numpy as np
import pytest

from benchmarks import wire

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_default_codecs_stay_under_one_byte_per_parameter_per_peer_per_round():
    """int8 shards up and int4 parameter deltas down, counted by each peer's IOStats over the
    rounds after the first, in a real 4-peer lock-step collaboration."""
    got = wire.measure("int8", None, rounds=4, warmup=1)
    assert got["download_codec"] == "int4"
    assert 0.2 < got["up_bytes_per_param"] < 0.7, got
    assert 0.1 < got["down_bytes_per_param"] < 0.5, got
    assert got["up_bytes_per_param"] + got["down_bytes_per_param"] < 1.0
    assert np.all(np.isfinite(got["loss"])) and got["loss"][-1] < got["loss"][0]
