"""How soon the scheduler looks again: a round's ETA, and the floors that keep it from sleeping
past a full round.

The ETA is what the round lacks over the collaboration's speed. The live heartbeats give that
speed, but they lag twice: each volunteer heartbeats a new round only once it holds the new
state, and volunteers back from a long wait claim a speed their smoothing has not caught up
with. Too slow an ETA costs the round (the scheduler, and through the view's ETA the
volunteers, look again past the target); too fast, a poll. So the speed is never below the
last round's heartbeats until its volunteers all heartbeat again, nor below the last round's
own pace by the scheduler's clock; and live volunteers of whom none computes (a new
scheduler's first polls) get a poll soon, backing off.
"""

from __future__ import annotations

from ..protocol import heartbeat, view
from ..protocol.config import Cadence


class Pace:
    """One scheduler's ETA for the open round, from what each published view counted."""

    def __init__(self, cadence: Cadence) -> None:
        self.cadence = cadence
        self.eta: float | None = None  # the last published view's ETA
        self._still = (-1, 0)  # (round, its polls in a row that saw live peers and none computing)
        # (round, the live peers' speed summed, their volunteers) as the last open view of a round
        # counted them, and of the round before it
        self._counted: tuple[int, float, frozenset[str]] = (-1, 0.0, frozenset())
        self._before: tuple[int, float, frozenset[str]] | None = None
        self._rate: tuple[int, float] = (-1, 0.0)  # (round, its samples over its length), at its CLOSE

    def closed(self, r: int, samples: int, round_s: float) -> None:
        """Round r closed with ``samples`` after ``round_s`` seconds of work (the scheduler's clock)."""
        self._rate = (r, samples / round_s) if round_s > 0 else (r, 0.0)

    def count(self, r: int, target: int, samples: int, pending: heartbeat.Pending, closed: bool) -> float | None:
        """Round r's ETA as a view counts it (``samples`` validated, ``pending`` live heartbeats)."""
        self.eta = view.eta(target, samples, pending.samples, self._speed(r, pending, closed), closed)
        still = self.eta is None and pending.peers and not closed
        self._still = (r, self._still[1] + 1 if self._still[0] == r else 1) if still else (r, 0)
        return self.eta

    def _speed(self, r: int, pending: heartbeat.Pending, closed: bool) -> float:
        """The live heartbeats' speed, at least the round before's until every volunteer counted
        there has heartbeaten in this one, and never below the round before's own pace."""
        if not closed:
            if self._counted[0] != r:
                self._before = self._counted if self._counted[0] == r - 1 else None
            self._counted = (r, pending.samples_per_s, pending.volunteers)
        before = self._before if self._before is not None and self._before[0] == r - 1 else None
        measured = self._rate[1] if self._rate[0] == r - 1 else 0.0
        if before is not None and not before[2] <= pending.volunteers:
            return max(pending.samples_per_s, before[1], measured)
        return max(pending.samples_per_s, measured)

    def wait(self) -> float:
        """Seconds to the next poll: a share of the ETA (``cadence.scheduler_s``); with live peers
        of whom none computes, poll_min_s, twice that, ... up to the slowest poll."""
        still = self._still[1]
        if still:
            return min(self.cadence.scheduler_poll_s, self.cadence.poll_min_s * 2 ** (still - 1))
        return self.cadence.scheduler_s(self.eta)
