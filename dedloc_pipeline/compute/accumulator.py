"""What a volunteer has computed and not yet sent: gradient sums, or diloco's inner steps.

The default algorithm sums micro-batches' gradients in the model's own ``grad`` for one round
and sends the sum. In the local-steps mode (``algorithm: diloco``, docs/diloco.md) the
volunteer's own optimizer steps every ``inner_batch`` samples and a shard carries where those
steps took the model: the state minus the local parameters. Either way the samples are counted
toward one round, and carried to the next at most once, as one step stale.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model.flat import FlatLayout
from ..protocol.config import RunConfig
from . import optim

log = logging.getLogger(__name__)


@dataclass
class Accumulator:
    """Gradient sums in ``model.grad`` for one round, and the samples they came from."""

    round: int
    samples: int = 0
    stale_samples: int = 0
    loss_sum: float = 0.0
    ranges: list[list[int]] = field(default_factory=list)
    unstepped: int = 0  # diloco: samples in ``model.grad`` that no inner step has taken yet
    steps: list[int] = field(default_factory=list)  # diloco: the samples each inner step took

    def add(self, cursor: int, n: int, loss: float, stale: bool) -> None:
        """Samples ``cursor`` to ``cursor + n`` of the peer's stream, summed in."""
        self.loss_sum += loss
        if self.ranges and self.ranges[-1][0] + self.ranges[-1][1] == cursor:
            self.ranges[-1][1] += n
        else:
            self.ranges.append([cursor, n])
        self.samples += n
        self.unstepped += n
        self.stale_samples += n if stale else 0

    def carry(self, delayed: bool) -> bool:
        """Count these samples toward the next round instead, as one step stale: only with
        delayed updates, and only once (carried again, some would be two steps stale, which no
        shard may say)."""
        if not delayed or self.stale_samples:
            return False
        self.round, self.stale_samples = self.round + 1, self.samples
        return True

    def back(self, state: int) -> None:
        """Computed on state ``state`` ahead for the next round, toward round ``state`` after all:
        it turned out short (a shard rejected, or the cap lifted), and these samples are fresh
        there. Never kept ahead of a round that needs them, they never pile up unsent."""
        self.round, self.stale_samples = state, 0


class Accumulation:
    """This volunteer's model and what is accumulated on it (``acc``; None: nothing yet), with
    diloco's inner optimizer, whose state stays on this machine: fresh with each shard
    (``inner_state: shard``), or kept across them."""

    def __init__(self, model: torch.nn.Module, config: RunConfig) -> None:
        self.model, self.config = model, config
        self.flat = FlatLayout(model)
        self.acc: Accumulator | None = None
        self.cursor = 0  # where this peer's stream continues
        self.compute_s = 0.0  # in forward and backward: the share of wall time that is training
        self.inner = None
        if config.algorithm == "diloco":
            named = dict(model.named_parameters())
            self.inner = optim.torch_optimizer(config.optimizer, [named[t.name] for t in self.flat.tensors if t.decay],
                                               [named[t.name] for t in self.flat.tensors if not t.decay])
        self.base = None  # diloco: where the model's inner steps started, as the model holds it

    def compute(self, round_: int, n: int, train: Callable[[int, int], float], stale: bool) -> None:
        """The next ``n`` samples of the stream toward round ``round_`` (``stale``: computed on
        the state before it)."""
        if self.acc is None:
            self.acc = Accumulator(round=round_)
            self.model.zero_grad(set_to_none=False)
            if self.inner is not None and self.config.inner_state == "shard":
                self.inner.state.clear()  # a fresh start: the shard is its samples' alone, replayable
        t0 = time.perf_counter()
        loss = train(self.cursor, n)
        self.compute_s += time.perf_counter() - t0
        self.acc.add(self.cursor, n, loss, stale)
        self.cursor += n

    def inner_step_due(self, state: int) -> None:
        if self.inner is not None and self.acc.unstepped >= self.config.inner_batch:
            self.inner_step(state)

    def inner_step(self, state: int) -> None:
        """diloco: one optimizer step on this volunteer's model, on the mean gradient of the
        samples since the last one. The learning rate follows the round, as in the default
        algorithm (its schedule counts rounds): the same for every volunteer, whatever its
        speed or arrival."""
        acc = self.acc
        if not acc.unstepped:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in self.model.parameters():  # one the batch never reached steps on zero, as at an aggregator
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.div_(acc.unstepped)
        for group in self.inner.param_groups:
            group["lr"] = optim.lr_at(self.config.optimizer, state + 1)
        self.inner.step()
        self.model.zero_grad(set_to_none=False)
        acc.steps.append(acc.unstepped)
        acc.unstepped = 0
        self.compute_s += time.perf_counter() - t0

    def update(self, state: int):
        """What a shard of ``acc`` carries, copied out: diloco's pseudo-gradient (the state minus
        where the inner steps went), else the gradient sum (divided by the samples on the
        transfer thread)."""
        if self.inner is None:
            return self.flat.grad()
        self.inner_step(state)
        return self.base - self.flat.get()

    def rebase(self, params) -> None:
        """Compute on ``params`` (a new state) from now on; in diloco the inner steps not yet
        sent move with the state (their pseudo-gradient stays)."""
        moved = self.flat.get() - self.base if self.inner is not None and self.acc is not None else None
        self.flat.set(params if moved is None else params + moved)
        self.base = self.held(params)

    def drop(self, params) -> None:
        """Forget the accumulated samples; in diloco the inner steps too (back to ``params``, the
        state)."""
        self.acc = None
        self.model.zero_grad(set_to_none=False)
        if self.inner is not None and params is not None:
            self.flat.set(params)
            self.base = self.held(params)

    def held(self, params):
        """``params`` as the model holds them: themselves in float32, rounded in bfloat16 (so a
        pseudo-gradient is only what the inner steps moved)."""
        if self.inner is None:
            return None
        dtype = next(self.model.parameters()).dtype
        return params if dtype == torch.float32 else torch.from_numpy(params).to(dtype).float().numpy()

    def retarget(self, state: int, params, delayed: bool, peer: str) -> None:
        """A new state: what was accumulated for the round before it is carried once, as stale;
        anything older, or carried already, is dropped (the round closed without it)."""
        acc = self.acc
        if acc is None or acc.round >= state:
            return
        if not (acc.round == state - 1 and acc.carry(delayed)):
            log.info("%s: dropping %d samples of closed round %d", peer, acc.samples, acc.round)
            self.drop(params)
