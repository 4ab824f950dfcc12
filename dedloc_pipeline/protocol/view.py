"""The round view: one small object the scheduler publishes each poll, all a volunteer reads.

A volunteer used to list the round's manifests and read every other peer's heartbeat each poll:
O(peers) requests per volunteer, O(peers²) for the collaboration, and it trusted sample counts
nobody had validated. Now the scheduler, which validates every manifest anyway, reads the
round's heartbeats once per poll (O(peers)), bounds them, and writes ``runs/RUN/VIEW.json``
(``RunLayout.view``; only the organizer's credentials may write it): the newest state, the
samples of the shards it accepted (after the norm screen), the live peers' pending samples and
speed, closed and stopped, an ETA. A volunteer reads that one object per poll (one GET).

Every value a volunteer writes is a claim, so a heartbeat is bounded before it counts
(``protocol/heartbeat.py``). The view itself is bounded too (``MAX_VIEW_BYTES``, its schema: no
more than that is fetched), signed in a signed run, and read defensively: a missing,
unreadable or forged view is no view.

Torch-free: the scheduler, ``dedloc status`` and the volunteer's display import it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..storage.bucket import Bucket
from ..storage.layout import RunLayout
from ..trust import identity
from .clock import REAL, Clock

if TYPE_CHECKING:
    from .config import Cadence

log = logging.getLogger(__name__)

VIEW_VERSION = 1
MAX_VIEW_BYTES = 4096  # an honest view is ~400 bytes; anything larger is not parsed
# the scheduler rewrites a view that did not change after this share of peer_timeout_s at the
# least (``next_s``; in long rounds a share of the round, as heartbeats), and a reader calls it
# stale once unchanged for that plus the rest of peer_timeout_s (``lifetime``)
KEEPALIVE = 2 / 3


class View(BaseModel):
    """The round view as published (``VIEW.json``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = VIEW_VERSION
    state: int = Field(ge=0, description="the newest committed state when it was written")
    round: int = Field(ge=0, description="the open round (computed against state ``round``)")
    target: int = Field(gt=0)
    validated_samples: int = Field(0, ge=0, description="samples of the shards the scheduler accepted so far")
    shards: int = Field(0, ge=0, description="accepted shards")
    rejected: int = Field(0, ge=0, description="rejected shards (the CLOSE, once written, says why)")
    pending_samples: int = Field(0, ge=0, description="the live peers' un-uploaded samples, each clamped")
    peers: int = Field(0, ge=0, description="live peers: a heartbeat for this round within peer_timeout_s")
    samples_per_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="their speed, summed")
    ahead_peers: int = Field(0, ge=0, description="live peers heartbeating the next round: computing ahead "
                             "while this one fills or is reduced (read every peer_timeout_s)")
    ahead_samples_per_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="their speed, summed")
    ignored_heartbeats: int = Field(0, ge=0, description="heartbeats skipped: oversized or malformed")
    closed: bool = False
    reveal: Literal["screen", "screened", "sums", "norms", "parts"] | None = Field(
        None, description="what the closed round's volunteer aggregators may do (checks/exchange.py): show their "
        "checks of the shards CLOSE admitted unread (screen), then reduce the shards the checks kept (screened); with "
        "LAMB, show their parts' partial sums (sums), then step with the norms recorded (norms); show their "
        "answers (parts)")
    stopped: bool = False
    ended: str | None = Field(None, max_length=200, description="why no scheduler will close this round: the "
                              "last one ended (its --until-round reached, its wall time, STOP, or it exited); "
                              "whoever starts one again continues the run")
    eta_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    cap: int | None = Field(None, ge=0, description="the most samples one volunteer counts for in the open "
                            "round now (admission.weigh): a volunteer with that many in sends no further part")
    horizon_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="how long past ``at`` the pending "
                             "samples may be projected: until the counted peers' next heartbeats are due")
    at: float = Field(allow_inf_nan=False, description="when the scheduler started this poll (its clock): "
                      "heartbeats and manifests were listed after it")
    written_at: float = Field(allow_inf_nan=False, description="when it was written: no heartbeat written "
                              "later is counted")
    next_s: float | None = Field(None, ge=0, allow_inf_nan=False, description="seconds after ``written_at`` "
                                 "by which the scheduler writes it again, changed or not (its keep-alive)")


def keepalive_s(timeout: float, cadence: Cadence, round_s: float | None) -> float:
    """Seconds after which the scheduler writes an unchanged view again, in rounds of
    ``round_s`` (None: not known yet): ``KEEPALIVE`` of ``timeout`` (the run's
    ``peer_timeout_s``), or in long rounds a heartbeat's keep-alive (``cadence.heartbeat_s``):
    the view changes with each wave of heartbeats and shards anyway, and the keep-alive alone
    says that a scheduler is there."""
    return max(timeout * KEEPALIVE, cadence.heartbeat_s(round_s))


def lifetime(v: View | None, timeout: float, cap: float) -> float:
    """Seconds a view stands unchanged before it counts as stale: ``timeout`` (the run's
    ``peer_timeout_s``), or its keep-alive (``next_s``, at most ``cap``: the run's longest
    heartbeat interval) plus a third of ``timeout`` when that is longer: shaped like
    ``heartbeat.lifetime``, with the slack that makes the shortest keep-alive stand exactly
    ``timeout``."""
    due = 0.0 if v is None or v.next_s is None else min(v.next_s, cap)
    return max(timeout, due + timeout * (1 - KEEPALIVE))


def read(bucket: Bucket, keys: RunLayout, organizer_key: str | None = None) -> View | None:
    """The published view (one GET), or None when there is none or it is unusable (``parse``)."""
    try:
        raw = bucket.read_if_changed(keys.view, None, limit=MAX_VIEW_BYTES + 1).data  # more is refused unread
    except Exception as exc:  # a bucket hiccup: no view this poll, the caller carries on
        log.warning("round view unreadable: %s", exc)
        return None
    return parse(raw, organizer_key, keys.run)


class Reader:
    """A volunteer's copy of the view, refreshed by a conditional GET (``If-None-Match`` its
    ETag): an unchanged view costs no body. The scheduler rewrites the view at least every
    ``next_s`` it states, so a view seen unchanged by reads its ``lifetime`` apart (this
    machine's clock: no agreement between the two machines' clocks needed) is stale. It is
    judged at reads, not between them: a reader that looks seldom (a long micro-batch) does not
    call a live scheduler's view stale for the time it did not look. The first view read is judged
    by its own ``at`` (no change seen yet)."""

    def __init__(self, timeout: float, cap: float, clock: Clock = REAL, organizer_key: str | None = None) -> None:
        self.timeout, self.cap, self.clock, self.organizer_key = timeout, cap, clock, organizer_key
        self.view: View | None = None
        self._tag: str | None = None
        self._changed = float("-inf")  # clock.monotonic() of the last change seen
        self._read_at = float("-inf")  # ... of the last read, answered or not

    def read(self, bucket: Bucket, keys: RunLayout) -> View | None:
        """The newest view (None if there is none or it is unusable); ``fresh`` says whether it
        still counts."""
        self._read_at = self.clock.monotonic()
        try:
            got = bucket.read_if_changed(keys.view, self._tag, limit=MAX_VIEW_BYTES + 1)  # more is refused unread
        except Exception as exc:  # a bucket hiccup: no new view this poll; freshness decides
            log.warning("round view unreadable: %s", exc)
            return self.view
        if got.changed:
            first = self._tag is None
            self._tag, self.view = got.tag, parse(got.data, self.organizer_key, keys.run)
            if self.view is not None and not (first and abs(self.clock.time() - self.view.at) >= self.lifetime):
                self._changed = self.clock.monotonic()
        return self.view

    @property
    def changed(self) -> float:
        """``clock.monotonic()`` when the view last changed (-inf: never seen change)."""
        return self._changed

    @property
    def lifetime(self) -> float:
        """How long the view in hand stands unchanged (``lifetime``)."""
        return lifetime(self.view, self.timeout, self.cap)

    @property
    def fresh(self) -> bool:
        return self.view is not None and self._read_at - self._changed < self.lifetime


def parse(raw: bytes | None, organizer_key: str | None = None, run: str | None = None) -> View | None:
    """The view in ``raw``, or None: absent, oversized, malformed, or in a signed run (``organizer_key``)
    not signed by the organizer for run ``run`` (logged: no view, as if no scheduler published)."""
    if raw is None:
        return None
    if len(raw) > MAX_VIEW_BYTES:
        log.warning("round view of %d bytes, above %d: ignored", len(raw), MAX_VIEW_BYTES)
        return None
    try:
        if organizer_key is not None:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise identity.IdentityError("the round view is not signed by the run's organizer: refused")
            identity.check_place(identity.check_record(organizer_key, body, "the round view"), "the round view",
                                 run=run)
        return View.model_validate_json(raw)
    except identity.IdentityError as exc:
        log.warning("%s: ignored", exc)
        return None
    except ValidationError as exc:
        log.warning("round view malformed: %s", exc.errors()[0].get("msg") if exc.errors() else exc)
        return None
    except ValueError as exc:
        log.warning("round view malformed: %s", exc)
        return None


def write(bucket: Bucket, keys: RunLayout, view: View, record: Callable[..., dict] | None = None) -> None:
    """Publish ``view``; in a signed run ``record`` (``Run.record``) names the run and signs it:
    anyone able to write VIEW.json (every volunteer, on R2) could otherwise make every worker
    hold its samples with a view that says closed, stopped, or full."""
    data = view.model_dump_json() if record is None else json.dumps(record("round view", view.model_dump(mode="json")))
    bucket.write_bytes(keys.view, data.encode())


def eta(target: int, validated: int, pending: int, samples_per_s: float, closed: bool) -> float | None:
    """Seconds until the round can fill at ``samples_per_s``; 0 once closed or full; None if
    nobody computes. The one ETA: the scheduler's view, the worker, its display and ``dedloc
    status`` all ask it."""
    remaining = max(0, target - validated - pending)
    if closed or remaining == 0:
        return 0.0
    return remaining / samples_per_s if samples_per_s > 0 else None


# what a worker makes of it

@dataclass
class RoundView:
    """Round ``state`` as one worker sees it: the validated samples (plus its own shards the view
    does not show yet), and the other live peers' pending samples and speed."""

    manifest_samples: int = 0
    fresh_samples: int = 0  # other peers' un-uploaded samples, from live heartbeats
    peers: int = 0  # other live peers
    ahead_peers: int = 0  # other live peers computing for the next round: live, though not in this one's count
    ahead_samples_per_s: float = 0.0  # their speed together
    samples_per_s: float = 0.0  # their speed together
    closed: bool = False
    ended: str | None = None  # the scheduler ended: nobody will close this round until one starts again
    at: float = 0.0
    eta_s: float | None = None  # the scheduler's, as of ``at``
    horizon_s: float = 0.0  # how long past ``at`` fresh_samples may grow at samples_per_s
    capped: bool = False  # this peer's shards in the view reach its cap: a further part would not count


def for_worker(v: View, own_pending: int, own_speed: float, own_counted: bool, own_unseen: int,
               own_seen: int = 0, own_ahead: float | None = None) -> RoundView:
    """A worker's RoundView from the published one: its own heartbeat that the view counted
    (``own_pending``, ``own_speed``, ``own_counted``) taken out, its own shards the view could not
    have seen yet (``own_unseen`` samples) added; never below zero. ``own_seen``: the samples of
    its shards the view could count, which make it ``capped`` once they reach the view's cap;
    ``own_ahead``: the speed of its own heartbeat among the view's ``ahead_peers`` (None: not there).
    Which of its heartbeats the scheduler counted is a guess (``upload_policy.from_view``): where
    no other peer is left, what remains of the counts is this peer's own, so it is none."""
    peers = max(0, v.peers - int(own_counted))
    ahead_peers = max(0, v.ahead_peers - int(own_ahead is not None))
    return RoundView(manifest_samples=v.validated_samples + own_unseen,
                     fresh_samples=max(0, v.pending_samples - own_pending) if peers else 0,
                     peers=peers, ahead_peers=ahead_peers,
                     ahead_samples_per_s=max(0.0, v.ahead_samples_per_s - (own_ahead or 0.0)) if ahead_peers else 0.0,
                     samples_per_s=max(0.0, v.samples_per_s - own_speed) if peers else 0.0, closed=v.closed,
                     ended=v.ended, at=v.at,
                     eta_s=v.eta_s, horizon_s=v.horizon_s,
                     capped=v.cap is not None and own_seen > 0 and own_seen >= v.cap and not v.closed)
