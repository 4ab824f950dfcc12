"""How a closed round ends, in one order that ``Scheduler.finish`` and the Prefect round flow both
follow: the volunteer aggregators settle what they agree on, the organizer reduces and steps the
parts they left, flags whoever lied (which needs the organizer's own answers), then commits.

Each step is a callable, so the engine runs them on a thread pool and the flow as Prefect tasks
with retries; the order, and which parts are left to the organizer, are written here only. Each
step's seconds (by the driver's clock) go into the COMMIT (``stages``): the organizer's share of
the round's latency, stage by stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .referee import Settlement


@dataclass(frozen=True)
class CloseOut:
    """The steps of ending one closed round, each run to completion before the next."""

    settle: Callable[[], Settlement]  # the parts the round's aggregators agree on, by its deadline
    reduce: Callable[[list[int]], object]  # reduce these parts (in parallel)
    apply: Callable[[list[int]], object]  # step these parts and write them into the next state
    flag_liars: Callable[[Settlement], None]  # flag the aggregators whose answers were not the organizer's
    commit: Callable[[dict[str, float]], dict]  # the next state's COMMIT (the ledger), with the stages' seconds


def close_out(n_parts: int, steps: CloseOut, clock: Callable[[], float] = time.monotonic) -> dict:
    """End a closed round of ``n_parts`` parts through ``steps``; the COMMIT written, with how
    long each step before it took (``clock``: seconds)."""
    stages, t0 = {}, clock()

    def took(stage: str) -> None:
        nonlocal t0
        now = clock()
        stages[stage], t0 = round(now - t0, 6), now
    settled = steps.settle()
    took("settle_s")
    left = [k for k in range(n_parts) if k not in settled.agreed]
    steps.reduce(left)
    took("reduce_s")
    steps.apply(left)
    took("apply_s")
    steps.flag_liars(settled)
    took("judge_s")
    return steps.commit(stages)
