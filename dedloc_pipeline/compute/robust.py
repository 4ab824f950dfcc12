"""Robust aggregation: a gradient estimate that a minority of byzantine shards cannot drag far.

The plain sample-weighted mean is what makes N peers equal to one process, and one shard scaled
×1000 or sign-flipped moves it anywhere. Both estimators here work on one aggregator part at a
time, as in BTARD (Gorbunov et al., 2022), over volunteers, not shards: a volunteer's parts of
the round are combined first (their sample-weighted mean), so uploading many parts buys no extra
rows, and each volunteer is weighted by its samples capped at the median volunteer's, so claiming
a large batch buys no extra influence:

- ``trimmed_mean``: per coordinate, drop the ``trim_fraction`` largest and smallest values, then
  take the weighted mean of the rest;
- ``centered_clip`` (Karimireddy et al., 2021): start at the coordinate-wise median and move
  toward each shard by at most the radius ``tau`` (the median distance of the shards from the
  start), a few fixed-point iterations.
"""

from __future__ import annotations

import numpy as np


def weights(samples: list[int]) -> np.ndarray:
    s = np.asarray(samples, np.float64)
    return np.minimum(s, np.median(s))


def trimmed_mean(x: np.ndarray, w: np.ndarray, trim: float) -> np.ndarray:
    k = len(x)
    t = min(int(trim * k), (k - 1) // 2)
    order = np.argsort(x, axis=0, kind="stable")[t:k - t]
    kept, kw = np.take_along_axis(x, order, axis=0).astype(np.float64), w[order]
    return ((kept * kw).sum(axis=0) / kw.sum(axis=0)).astype(np.float32)


def _norms(d: np.ndarray) -> np.ndarray:
    """Each row's L2 norm in numpy's fixed pairwise order (BLAS's follows threads and CPU): the
    same bits on every machine, as checked aggregation needs (``optim``)."""
    return np.sqrt(np.add.reduce(np.square(d), axis=1))


def centered_clip(x: np.ndarray, w: np.ndarray, iters: int) -> np.ndarray:
    v = np.median(x, axis=0).astype(np.float64)
    tau = float(np.median(_norms(x - v)))
    for _ in range(iters):
        diff = x - v
        dist = _norms(diff)
        c = np.minimum(1.0, tau / np.maximum(dist, 1e-30)) * w
        v = v + (c[:, None] * diff).sum(axis=0) / w.sum()
    return v.astype(np.float32)


def aggregate(x: np.ndarray, samples: list[int], config) -> np.ndarray:
    """The robust estimate of the mean gradient over one part: ``x`` has a row per volunteer
    (its parts combined), ``samples`` its samples."""
    w = weights(samples)
    if config.aggregation == "trimmed_mean":
        return trimmed_mean(x, w, config.trim_fraction)
    if config.aggregation == "centered_clip":
        return centered_clip(x, w, config.clip_iters)
    raise ValueError(f"unknown aggregation {config.aggregation!r}")
