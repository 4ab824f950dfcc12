"""Optimizer steps on a range of the flat vector, with that range's slice of optimizer state.

An aggregator owns chunks, not tensors, so a range may cut a tensor in two. AdamW and SGD are
elementwise and run on each tensor piece as it is (through ``torch.optim`` itself). LAMB scales each
tensor by a trust ratio ||p|| / ||u|| over the *whole* tensor, so it takes two passes: every range
first reports per-tensor partial sums of squares (``partials``), then ``apply`` combines them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..model.flat import FlatLayout
from .config import OptimizerConfig

STATE = OptimizerConfig().slots  # AdamW's (and LAMB's) moments, per element


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then optional linear decay."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.total_steps:
        left = (cfg.total_steps - step) / max(1, cfg.total_steps - cfg.warmup_steps)
        return cfg.lr * max(0.0, left)
    return cfg.lr


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


def _lamb_direction(cfg: OptimizerConfig, p, m, v, g, step: int, decay: bool):
    """Updates m, v in place; returns LAMB's direction u (before the trust ratio)."""
    b1, b2 = cfg.betas
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    u = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + cfg.eps)
    if decay and cfg.weight_decay:
        u = u + cfg.weight_decay * p
    return u


def partials(cfg: OptimizerConfig, layout: FlatLayout, lo: int, p: np.ndarray, state: dict,
             g: np.ndarray, step: int) -> dict[str, list[float]]:
    """Per-tensor [sum p^2, sum u^2] over this range, for LAMB's trust ratios."""
    out: dict[str, list[float]] = {}
    for t, a, b in layout.pieces(lo, lo + len(p)):
        s = slice(a - lo, b - lo)
        pp = _t(p[s])
        u = _lamb_direction(cfg, pp, _t(state["exp_avg"][s]).clone(),
                            _t(state["exp_avg_sq"][s]).clone(), _t(g[s]), step, t.decay)
        acc = out.setdefault(t.name, [0.0, 0.0])
        acc[0] += float(pp.double().square().sum())
        acc[1] += float(u.double().square().sum())
    return out


def apply(cfg: OptimizerConfig, layout: FlatLayout, lo: int, p: np.ndarray, state: dict,
          g: np.ndarray, step: int, norms: dict[str, list[float]] | None = None) -> None:
    """One optimizer step on p[lo:lo+len(p)], in place on ``p`` and ``state``."""
    lr = lr_at(cfg, step)
    pieces = [(t, slice(a - lo, b - lo)) for t, a, b in layout.pieces(lo, lo + len(p))]
    if cfg.name in ("adamw", "sgd"):
        groups = {True: [], False: []}
        tstate = {}
        for t, s in pieces:
            w = torch.nn.Parameter(_t(p[s]))
            w.grad = _t(g[s])
            groups[t.decay].append(w)
            tstate[w] = {name: _t(state[name][s]) for name in cfg.slots}
            if cfg.name == "adamw":
                tstate[w]["step"] = torch.tensor(float(step - 1))
        opt = torch_optimizer(cfg, groups[True], groups[False], lr)
        opt.state.update(tstate)
        opt.step()
        return
    for t, s in pieces:
        pp = _t(p[s])
        u = _lamb_direction(cfg, pp, _t(state["exp_avg"][s]), _t(state["exp_avg_sq"][s]),
                            _t(g[s]), step, t.decay)
        p_sq, u_sq = norms[t.name]
        trust = math.sqrt(p_sq) / math.sqrt(u_sq) if p_sq > 0 and u_sq > 0 else 1.0
        pp.sub_(u, alpha=lr * min(trust, cfg.clamp))


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
