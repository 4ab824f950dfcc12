"""How a closed round ends, in one order that ``Scheduler.finish`` and the Prefect round flow both
follow: the volunteer aggregators settle what they agree on, the organizer reduces and steps the
parts they left, flags whoever lied (which needs the organizer's own answers), then commits.

Each step is a callable, so the engine runs them on a thread pool and the flow as Prefect tasks
with retries; the order, and which parts are left to the organizer, are written here only.
"""

from __future__ import annotations

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
    commit: Callable[[], dict]  # the next state's COMMIT (the ledger)


def close_out(n_parts: int, steps: CloseOut) -> dict:
    """End a closed round of ``n_parts`` parts through ``steps``; the COMMIT written."""
    settled = steps.settle()
    left = [k for k in range(n_parts) if k not in settled.agreed]
    steps.reduce(left)
    steps.apply(left)
    steps.flag_liars(settled)
    return steps.commit()
