"""Optimizer steps on a range of the flat vector, with that range's slice of optimizer state.

An aggregator owns chunks, not tensors, so a range may cut a tensor in two. AdamW and SGD are
elementwise and run on each tensor piece as it is. LAMB scales each tensor by a trust ratio
||p|| / ||u|| over the *whole* tensor, so it takes two passes: every range first reports
per-tensor partial sums of squares (``partials``), then ``apply`` combines them.

The step is bitwise reproducible: the same inputs give the same bytes on any machine that runs
this code, whatever its threads or vector units, so two aggregators' answers can be compared bit
for bit (docs/design.md, "Checked aggregation"). So it is written here in numpy, one IEEE float32
operation at a time (each correctly rounded, none fused: ``torch.optim``'s kernels use fused
multiply-adds where the CPU has them, and gave other bits than these on 11% of AdamW's first
moments here), with torch's formulas and order. Sums of squares are exact in float64 for float32
values and added in numpy's fixed pairwise order. The volunteers' inner steps (diloco) keep
``torch.optim``: they run on their GPUs and are replayed within a tolerance, not bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..model.flat import FlatLayout
from ..protocol.config import OptimizerConfig

STATE = OptimizerConfig().slots  # AdamW's (and LAMB's) moments, per element
F = np.float32  # every scalar of a step is rounded to float32 first, as torch does


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then optional linear decay."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.total_steps:
        left = (cfg.total_steps - step) / max(1, cfg.total_steps - cfg.warmup_steps)
        return cfg.lr * max(0.0, left)
    return cfg.lr


def sum_squares(x: np.ndarray) -> float:
    """Σ x², the same on every machine: float32 squares are exact in float64, and numpy adds
    them in its fixed pairwise order (no BLAS, whose order follows threads and CPU)."""
    return float(np.add.reduce(np.square(x, dtype=np.float64)))


def _adamw(cfg: OptimizerConfig, p, m, v, g, step: int, lr: float, decay: bool) -> None:
    """torch's AdamW (single tensor), in place: decoupled decay, moments, the bias-corrected step."""
    b1, b2 = cfg.betas
    if decay and cfg.weight_decay:
        p *= F(1 - lr * cfg.weight_decay)
    m += (g - m) * F(1 - b1)  # torch's lerp_
    v *= F(b2)
    v += g * g * F(1 - b2)
    denom = np.sqrt(v) / F(math.sqrt(1 - b2 ** step))
    denom += F(cfg.eps)
    p += m / denom * F(-lr / (1 - b1 ** step))


def _sgd(cfg: OptimizerConfig, p, buf, g, lr: float, decay: bool) -> None:
    """torch's SGD, in place: L2 decay, momentum (a zero buffer starts as the gradient), Nesterov."""
    d = g + p * F(cfg.weight_decay) if decay and cfg.weight_decay else g
    if cfg.momentum:
        buf *= F(cfg.momentum)
        buf += d
        d = d + buf * F(cfg.momentum) if cfg.nesterov else buf
    p -= d * F(lr)


def _lamb_direction(cfg: OptimizerConfig, p, m, v, g, step: int, decay: bool) -> np.ndarray:
    """Updates m, v in place; returns LAMB's direction u (before the trust ratio)."""
    b1, b2 = cfg.betas
    m *= F(b1)
    m += g * F(1 - b1)
    v *= F(b2)
    v += g * g * F(1 - b2)
    u = (m / F(1 - b1 ** step)) / (np.sqrt(v / F(1 - b2 ** step)) + F(cfg.eps))
    if decay and cfg.weight_decay:
        u += p * F(cfg.weight_decay)
    return u


def partials(cfg: OptimizerConfig, layout: FlatLayout, lo: int, p: np.ndarray, state: dict,
             g: np.ndarray, step: int) -> dict[str, list[float]]:
    """Per-tensor [sum p^2, sum u^2] over this range, for LAMB's trust ratios."""
    out: dict[str, list[float]] = {}
    for t, a, b in layout.pieces(lo, lo + len(p)):
        s = slice(a - lo, b - lo)
        u = _lamb_direction(cfg, p[s], state["exp_avg"][s].copy(), state["exp_avg_sq"][s].copy(), g[s], step,
                            t.decay)
        acc = out.setdefault(t.name, [0.0, 0.0])
        acc[0] += sum_squares(p[s])
        acc[1] += sum_squares(u)
    return out


def apply(cfg: OptimizerConfig, layout: FlatLayout, lo: int, p: np.ndarray, state: dict,
          g: np.ndarray, step: int, norms: dict[str, list[float]] | None = None) -> None:
    """One optimizer step on p[lo:lo+len(p)], in place on ``p`` and ``state`` (float32 arrays)."""
    lr = lr_at(cfg, step)
    for t, a, b in layout.pieces(lo, lo + len(p)):
        s = slice(a - lo, b - lo)
        if cfg.name == "adamw":
            _adamw(cfg, p[s], state["exp_avg"][s], state["exp_avg_sq"][s], g[s], step, lr, t.decay)
        elif cfg.name == "sgd":
            _sgd(cfg, p[s], state["momentum_buffer"][s], g[s], lr, t.decay)
        else:
            u = _lamb_direction(cfg, p[s], state["exp_avg"][s], state["exp_avg_sq"][s], g[s], step, t.decay)
            p_sq, u_sq = norms[t.name]
            trust = math.sqrt(p_sq) / math.sqrt(u_sq) if p_sq > 0 and u_sq > 0 else 1.0
            p[s] -= u * F(lr * min(trust, cfg.clamp))


def merge_partials(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    total: dict[str, list[float]] = {}
    for part in parts:
        for name, (a, b) in part.items():
            acc = total.setdefault(name, [0.0, 0.0])
            acc[0] += a
            acc[1] += b
    return total


def torch_optimizer(cfg: OptimizerConfig, decayed: list, other: list, lr: float | None = None) -> torch.optim.Optimizer:
    """``torch.optim``'s AdamW or SGD as ``cfg`` says, weight decay on ``decayed`` only: the
    aggregators' step on a range, and a diloco volunteer's inner steps on its whole model."""
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    lr = cfg.lr if lr is None else lr
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=False)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
    raise ValueError(f"no torch optimizer for {cfg.name!r}")
