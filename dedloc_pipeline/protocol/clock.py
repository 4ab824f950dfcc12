"""Time as an input: every role that waits or timestamps reads this, so tests drive time.

The worker, the scheduler, the view reader and the validator take their clock from the run
(``Run.clock``, the real one by default) or as an argument; ``dedloc_pipeline.testing.FakeClock``
moves only when told, so timing cases (peer timeouts, killed workers, late joiners, stale views,
close timeouts) run in one process with exact assertions and no sleeps.
"""

from __future__ import annotations

import time


class Clock:
    """The real clock: wall time for records other machines read, monotonic time for intervals."""

    def time(self) -> float:
        """Seconds since the epoch: what goes into records (heartbeats, COMMIT, CLOSE)."""
        return time.time()

    def monotonic(self) -> float:
        """Seconds on this machine's steady clock: intervals, deadlines, rates."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


REAL = Clock()


def duration(seconds: float | None) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``: what a person reads at a glance."""
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
