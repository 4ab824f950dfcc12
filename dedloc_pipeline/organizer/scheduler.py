"""The round engine: close a round when enough samples are in, reduce, apply, commit.

Its steps are plain calls that return data, so ``dedloc aggregate`` (``Scheduler.serve``) and the
Prefect round flow (``flows/pretraining.py``, which adds tasks, mapping, retries and artifacts)
drive the same loop::

    while stop_reason(snap := scheduler.poll(), until_state, deadline, clock.monotonic()) is None:
        close = snap.close or scheduler.wait_close(snap.state, deadline_of_the_wait)
        if close:  reduce_part(r, k) for every part; apply_part(r, k) ...; commit(r)

A round closes in ``try_close``: each new manifest judged (``judge.py``: validation, then the
round's admission rules over the validated shards), then CLOSE (``close.py``); ``finish``
reduces and applies it (``aggregation.py``) and commits it (``ledger.py``). A poll lists the round
once, and writes the round view only when it has something new to say.

Everything it knows comes from the bucket, so it can be killed and started again anywhere: a
closed round is finished from its CLOSE marker, a half-applied state from its part markers, and
COMMIT is created at most once. One scheduler acts at a time: it holds the run's lease
(``lease.py``), and a second one is refused, naming the first, or waits (``standby``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from ..checks import admission, exchange
from ..compute import aggregation
from ..protocol import heartbeat, view
from ..protocol.clock import Clock
from ..protocol.close import Close, round_close
from ..protocol.run import Run, RunError
from ..storage.layout import volunteer_of
from ..trust import identity
from . import referee
from .close_out import CloseOut, close_out
from .judge import Judge, Listing
from .lease import LEASE_S, Lease
from .ledger import commit
from .pace import Pace

log = logging.getLogger(__name__)

# what changes in a view as time passes, with nothing new: not a reason to write it again
_PROJECTED = {"at", "written_at", "eta_s", "pending_samples", "horizon_s"}


@dataclass(frozen=True)
class Poll:
    """One poll of a run: all the round loop decides on."""

    state: int  # the newest committed state; round ``state`` is the open one
    close: Close | None  # that round's CLOSE, once it is closed
    stopped: bool  # the organizer wrote the run's STOP marker


ENDED = {"rounds": "the scheduler reached its last round (--until-round)",
         "wall time": "the scheduler reached its wall time", "STOP marker": "the run is stopped (dedloc stop)"}


def exited(exc: BaseException) -> str:
    """Why a scheduler's loop ended on ``exc``, as its last view says it to the volunteers."""
    if isinstance(exc, KeyboardInterrupt):  # SIGTERM and SIGHUP are taken as it (monitoring/stop.py)
        return "the scheduler was stopped (Ctrl-C, or SIGTERM)"
    detail = " ".join(str(exc).split())[:120]
    return f"the scheduler exited on {type(exc).__name__}" + (f": {detail}" if detail else "")


def stop_reason(snap: Poll, until_state: int | None = None, deadline: float | None = None,
                now: float | None = None) -> str | None:
    """Why the round loop ends now, or None to go on. A round already closed is still committed
    after STOP or past the deadline (a ``clock.monotonic()``, compared with ``now``): its volunteers'
    work is not lost."""
    if until_state is not None and snap.state >= until_state:
        return "rounds"
    if snap.close is not None:
        return None
    if deadline is not None and now > deadline:
        return "wall time"
    if snap.stopped:
        return "STOP marker"
    return None


class Scheduler:
    def __init__(self, run: Run, parallel: int = 2, poll_s: float | None = None, clock: Clock | None = None,
                 holder: str | None = None, lease_s: float = LEASE_S, volunteers: bool = False):
        """``poll_s`` fixes the seconds between polls; None follows the run's ``cadence``.
        ``holder`` names this scheduler in the run's lease (default ``host:pid``). ``volunteers``:
        the parts go to volunteer aggregators where two or more offer (``exchange.py``), the
        organizer computing what they do not settle."""
        self.run, self.parallel, self.poll_s = run, parallel, poll_s
        self.clock = run.clock if clock is None else clock
        if volunteers and (why := exchange.eligible(run)):
            raise RunError(f"run {run.name!r} cannot take volunteer aggregators: {why}")
        self.lease = Lease(run.bucket, run.keys, self.clock, holder, lease_s)
        self.referee = referee.Referee(run, self.clock, poll_s or 2.0, parallel,
                                       renew=self.lease.hold) if volunteers else None
        self.judge = Judge(run, parallel, defer=volunteers and run.config.algorithm != "diloco")
        self._beats = heartbeat.Heartbeats()
        self._ahead = heartbeat.Heartbeats()  # the next round's: peers computing ahead, for displays
        self._ahead_seen: tuple[int, float, heartbeat.Pending] = (-1, float("-inf"), heartbeat.Pending())
        self._started: dict[int, float] = {}  # round -> the first poll that saw work on it
        self._stopped = False  # STOP, as the last published view saw it
        self.pace = Pace(run.config.cadence)  # the round's ETA: how soon to poll again
        self._published: tuple | None = None  # what the last view written said, time aside
        self._round_s: float | None = None  # how long the last round took, from its first work to its CLOSE
        self._keepalive_due = float("-inf")  # clock.monotonic() from which an unchanged view is rewritten
        self._unclosed: int | None = None  # the round whose CLOSE this scheduler read and found absent
        self._over: frozenset[str] = frozenset()  # the peers whose prefixes held too much, last poll
        self._reached: dict[int, float] = {}  # round -> when its target was first reached (``_holds``)
        self._in_vain: set[str] = set()  # volunteers CLOSE waited for and closed without
        if run.signed:
            run.organizer("CLOSE")  # a scheduler that could not sign its CLOSEs fails here, not at the first

    def try_close(self, r: int, now: float | None = None) -> Close | None:
        """Write CLOSE for round r if its rule is met; the existing CLOSE if there is one. Either
        way, publish the round view if it changed: what volunteers read instead of the bucket.
        One LIST of the volunteers' prefixes shows everything it decides on (heartbeats,
        manifests and the shards' objects, of this round, the one before and the next), so a poll
        where nothing changed costs that LIST and STOP's HEAD. CLOSE is read once a round: while
        this scheduler holds the lease, nobody else writes it."""
        self.lease.hold()
        bucket, keys, rule, cfg = self.run.bucket, self.run.keys, self.run.config.close, self.run.config
        at = self.clock.time() if now is None else now
        listed = self._written()  # heartbeats and manifests, both as of `at`
        close = self._existing_close(r) if self._unclosed != r else None
        if close is not None:
            self.judge.closed(close)
            self._publish(r, at, listed, close=close)
            return close
        self._unclosed = r
        self.judge.forget_before(r - 1)
        self._started = {k: v for k, v in self._started.items() if k >= r - 1}
        self._reached = {k: v for k, v in self._reached.items() if k >= r}
        accepted, rejected = self.judge.verdicts(r, listed)
        refused = frozenset(keys.shard_parts(x.key)[1] for x in rejected)
        pending = self._beats.pending(bucket, keys, r, listed, at, cfg.peer_timeout_s, cfg.target_batch_size,
                                      cfg.cadence.heartbeat_max_s, self.judge.landed(accepted, rejected), refused)
        candidates = accepted + self.judge.late(r, listed)
        live = self.judge.enrolled(pending.volunteers)
        now = self.clock.time() if now is None else now
        target, opened = cfg.target_batch_size, self.judge.opening(r).at
        if pending.peers or candidates:  # a round's time runs from its first work, not an idle opening
            self._started.setdefault(r, max(opened, at))
        started = self._started.get(r, now)
        (accepted, samples, cap), out = self.judge.admitted(r, candidates, live, now, started)
        expired = admission.timed_out(opened, now, rule.timeout_s)
        if admission.closes(samples, target, rule.min_fraction, expired):
            version = self.judge.roster_version  # a roster changed since: every shard judged anew
            if self.judge.roster() is not None and self.judge.roster_version != version:
                return self.try_close(r, now)
            # flags written since the round opened count too
            (accepted, samples, cap), out = self.judge.admitted(r, candidates, live, now, started, reread_flags=True)
        rejected += self.judge.logged(r, out)
        if not admission.closes(samples, target, rule.min_fraction, expired) or \
                (not expired and self._holds(r, live & pending.unsent, now, started)):
            self._publish(r, at, listed, samples=samples, shards=len(accepted), rejected=len(rejected),
                          pending=pending, cap=cap)
            return None
        close = Close(round=r, samples=samples, target=target, accepted=sorted(accepted, key=lambda s: s.key),
                      roster=self.judge.roster_version, rejected=sorted(rejected, key=lambda s: s.key),
                      opened_at=opened, started_at=self._started.get(r), closed_at=now,
                      reason="target" if samples >= target else "timeout",
                      missed=self.judge.missed(r, listed))  # round r-1's shards that missed it: samples spent
        if self.referee is not None:
            roster = self.judge.roster()
            offers = self.referee.offers(r, listed, roster, self.judge.flags)
            person = roster.person if roster is not None else volunteer_of
            if assigned := exchange.assign(exchange.seed(close), self.run.n_parts, offers, person):
                close = close.model_copy(update={"aggregators": assigned, "aggregate_by": now + rule.aggregate_s})
            elif any(e.norm is None for e in close.accepted):  # admitted unread, and nobody left to check them
                close = self.judge.contents(close)
        if not bucket.create_json(keys.close(r), self.run.record(f"CLOSE of round {r}", close.dump(), round=r)):
            log.warning("round %d: a CLOSE was there already, not this scheduler's", r)
        self._unclosed = None
        close = self._existing_close(r)
        if close is None:  # a forged one stood there: deleted, so the next poll closes the round
            return None
        self.judge.closed(close)
        self._in_vain -= {volunteer_of(e.peer) for e in close.accepted}
        log.info("round %d closed: %d samples from %d shards (%d rejected)", r, close.samples,
                 len(close.accepted), len(close.rejected))
        self._publish(r, at, listed, close=close)
        return close

    def _holds(self, r: int, unsent: frozenset[str], now: float, started: float) -> bool:
        """Round r reached its target: whether CLOSE waits for the live volunteers with samples of
        it that sent no part yet (``unsent``). They see the round full when the others do and
        send at once, a poll or a download later; closed before their parts land, the samples
        (often carried from the round before, so never carried again) are lost. It waits
        ``close.grace`` of the time the round took to fill, at most, and not for a volunteer it
        waited for in vain before, until that one sends a part again: a name that claims pending
        samples and never sends costs one wait."""
        waiting = unsent - self._in_vain
        if not waiting:
            return False
        reached = self._reached.setdefault(r, now)
        limit = self.run.config.close.grace * max(0.0, reached - started)
        if now - reached < limit:
            return True
        if limit > 0:
            log.info("round %d: closed without the parts of %s, waited for %.1f s", r, ", ".join(sorted(waiting)),
                     now - reached)
            self._in_vain |= waiting
        return False

    def _written(self) -> Listing:
        """What the volunteers wrote (``Run.written``); a peer whose prefix holds too much is
        left out, and logged when it first is."""
        listed, over = self.run.written()
        for peer in sorted(over - self._over):
            log.error("peer %s: its prefix holds more than %d objects, more than any round needs: "
                      "nothing of it is read until the rounds are pruned", peer, self.run.per_volunteer)
        self._over = over
        return listed

    def _existing_close(self, r: int) -> Close | None:
        """Round r's CLOSE, if the organizer wrote one. A forged one (anyone with write access to
        the run could create it first) is deleted, so the round still closes, unless a reduction
        already began from what stood there: then only the organizer can say what is true."""
        keys = self.run.keys
        try:
            return Close.read(self.run, r)
        except identity.IdentityError as exc:
            if self.run.bucket.find(keys.reduced_dir(r)):
                raise RunError(f"{exc}, and round {r}'s reduction has begun: restore the true CLOSE or "
                               "delete the round's reduced/ folder with it") from exc
            log.error("%s: deleted; the round closes as its shards say", exc)
            self.run.bucket.delete(keys.close(r))
            return None

    def _publish(self, r: int, at: float, listed: Listing, samples: int = 0, shards: int = 0, rejected: int = 0,
                 pending: heartbeat.Pending = heartbeat.Pending(), close: Close | None = None,
                 cap: int | None = None, ended: str | None = None, reveal: str | None = None) -> None:
        """Write the round view of open round r (closed: from its CLOSE, no heartbeats) if it
        says something new (time's projections aside: workers project the pending samples
        themselves) or its keep-alive is due (``keepalive_s``), by which volunteers know a
        scheduler publishes. A failed write is logged, never raised: volunteers treat a view gone
        stale as no view."""
        bucket, keys, target = self.run.bucket, self.run.keys, self.run.config.target_batch_size
        if close is not None:
            samples, shards, rejected = close.samples, len(close.accepted), len(close.rejected)
            self._round_s = close.closed_at - (close.started_at or close.opened_at)
            self.pace.closed(r, close.samples, self._round_s)
        eta = self.pace.count(r, target, samples, pending, close is not None)
        try:
            self._stopped = self.run.stopped(delete_forged=True)
            ahead = self._ahead_of(r, at, listed, again=close is not None)
            v = view.View(state=r, round=r, target=target, validated_samples=samples, shards=shards,
                          rejected=rejected, pending_samples=pending.samples, peers=pending.peers,
                          samples_per_s=pending.samples_per_s, ahead_peers=ahead.peers,
                          ahead_samples_per_s=ahead.samples_per_s, ignored_heartbeats=pending.ignored,
                          horizon_s=pending.horizon_s, closed=close is not None, stopped=self._stopped,
                          eta_s=eta, cap=cap, ended=ended, reveal=reveal, at=at,
                          written_at=max(at, self.clock.time()), next_s=self.keepalive_s)
            beats = [(k, listed[k][1]) for k in keys.of_round(listed, r, "progress")]
            said = (tuple(sorted(v.model_dump(exclude=_PROJECTED).items())), tuple(beats))
            due = self.clock.monotonic() >= self._keepalive_due - 1e-3  # a sleep up to it lands within
            if said == self._published and not due:
                return
            view.write(bucket, keys, v, self.run.record if self.run.signed else None)
            self._published, self._keepalive_due = said, self.clock.monotonic() + self.keepalive_s
        except Exception as exc:
            log.warning("round %d: the round view was not published (%s)", r, exc)

    @property
    def keepalive_s(self) -> float:
        """Seconds after which an unchanged view is written again (``view.keepalive_s``), for
        rounds as long as the last."""
        return view.keepalive_s(self.run.config.peer_timeout_s, self.run.config.cadence, self._round_s)

    def _ahead_of(self, r: int, at: float, listed: Listing, again: bool = False) -> heartbeat.Pending:
        """Round r+1's live heartbeats (peers computing ahead) in ``listed``, for displays, not
        worth reading each poll: a peer computes ahead once round r looks full to it, so they
        are read only from an ETA of ``peer_timeout_s`` on (or none: everyone may have sent their
        parts), every ``peer_timeout_s``, and ``again`` for the closed view, which stands while
        the round is reduced."""
        seen_r, seen_at, pending = self._ahead_seen
        timeout, since = self.run.config.peer_timeout_s, self.clock.monotonic() - seen_at
        if not again and self.pace.eta is not None and self.pace.eta > timeout:  # nobody can be ahead yet
            return pending if seen_r == r and since < timeout else heartbeat.Pending()
        if again or seen_r != r or since >= timeout:
            cfg, keys = self.run.config, self.run.keys
            pending = self._ahead.pending(self.run.bucket, keys, r + 1, listed, at, cfg.peer_timeout_s,
                                          cfg.target_batch_size, cfg.cadence.heartbeat_max_s)
            self._ahead_seen = (r, self.clock.monotonic(), pending)
        return pending

    # the loop's steps
    def poll(self) -> Poll:
        """The run as the round loop sees it now; the lease taken or renewed first (LeaseHeld
        while another scheduler holds it)."""
        self.lease.hold()
        r = self.run.latest()
        return Poll(state=r, close=self._existing_close(r), stopped=self.run.stopped(delete_forged=True))

    def wait_close(self, r: int, deadline: float | None = None) -> Close | None:
        """Poll until round r closes (its CLOSE); None once the run is stopped or ``deadline``
        (``clock.monotonic()``) passes, so the loop can check its stop rules again. By default
        it polls every ``cadence.scheduler_poll_s``, faster near the target, and as the view's
        keep-alive falls due."""
        while True:
            close = self.try_close(r)
            if close is not None:
                return close
            if self._stopped:
                return None
            if deadline is not None and self.clock.monotonic() >= deadline:
                return None
            wait = self._wait() if self.poll_s is None else self.poll_s
            keepalive_in = self._keepalive_due - self.clock.monotonic()
            if keepalive_in > 0:  # past due (a write that failed) waits the poll, never spins
                wait = min(wait, keepalive_in)
            self.clock.sleep(wait if deadline is None else max(0.0, min(wait, deadline - self.clock.monotonic())))

    def _wait(self) -> float:
        """Seconds to the next poll (``Pace.wait``)."""
        return self.pace.wait()

    def finish(self, r: int, pool: Executor, close: Close | None = None) -> dict:
        """Reduce, apply and commit closed round r, parts in parallel on ``pool``, in the order
        every driver follows (``close_out``); safe to repeat after any crash. Parts the CLOSE
        gave volunteer aggregators are theirs until its deadline (``settle``); the organizer
        computes the others, then flags the aggregators that lied (``flag_liars``)."""
        run = self.run
        close = close or round_close(run, r, counted=False)
        return close_out(run.n_parts, CloseOut(
            settle=lambda: self.settle(close),
            reduce=lambda parts: list(pool.map(lambda k: aggregation.reduce_part(run, r, k), parts)),
            apply=lambda parts: list(pool.map(lambda k: aggregation.apply_part(run, r, k), parts)),
            flag_liars=lambda settled: self.flag_liars(close, settled),
            commit=lambda stages: commit(run, r, stages)), self.clock.monotonic)

    def settle(self, close: Close) -> referee.Settlement:
        """The parts of a closed round its volunteer aggregators settle by agreeing (none if its
        CLOSE assigned none); the round view says when they may reveal their answers."""
        if not close.aggregators:
            return referee.Settlement()
        return self._referee.settle(close, self.judge.roster(), reveal=lambda stage: self._publish(
            close.round, self.clock.time(), self._written(), close=close, reveal=stage))

    def flag_liars(self, close: Close, settled: referee.Settlement) -> None:
        """Once the organizer computed the parts its aggregators left: flag those that lied."""
        if settled.results or settled.liars:
            self._referee.judge(close, settled)

    @property
    def _referee(self) -> referee.Referee:
        """This scheduler's referee; a plain one for a CLOSE that another scheduler, run with
        volunteer aggregators, wrote."""
        return self.referee or referee.Referee(self.run, self.clock, parallel=self.parallel, renew=self.lease.hold)

    def step(self, pool: Executor) -> bool:
        """One unit of progress; False when the open round is still filling."""
        r = self.run.latest()
        if (close := self.try_close(r)) is None:
            return False
        self.finish(r, pool, close)
        return True

    def serve(self, until_round: int | None = None, max_wait_s: float | None = None, standby: bool = False) -> int:
        """Schedule rounds until state ``until_round`` is committed, or the run is stopped (a
        round already closed is still committed), or forever; a round that does not fill
        within ``max_wait_s`` raises TimeoutError. ``standby``: wait for the lease while
        another scheduler holds it, instead of LeaseHeld."""
        snap = None
        try:
            if standby:
                self.lease.wait()
            with ThreadPoolExecutor(self.parallel) as pool:
                while (reason := stop_reason(snap := self.poll(), until_round)) is None:
                    wait = None if max_wait_s is None else self.clock.monotonic() + max_wait_s
                    close = snap.close or self.wait_close(snap.state, wait)
                    if close is not None:
                        self.finish(snap.state, pool, close)
                    elif wait is not None and self.clock.monotonic() > wait:
                        raise TimeoutError(f"round {snap.state} did not fill within {max_wait_s:.0f}s")
        except BaseException as exc:  # Ctrl-C, or a failure the loop cannot go on from
            if snap is not None:
                self.end(snap.state, exited(exc))
            else:  # before its first poll: no round to speak of, but the lease goes at once
                self._release()
            raise
        self.end(snap.state, reason)
        if reason == "STOP marker":
            log.info("run %s stopped at state %d", self.run.name, snap.state)
        return snap.state

    def end(self, state: int, reason: str) -> None:
        """Say in the round view that no scheduler will close round ``state`` (``reason``: what
        ended the loop), so workers stop computing for it, and release the lease, so the next
        scheduler need not wait; its view replaces this one. A scheduler whose lease was taken
        over says nothing: the view is its successor's. Stopped as it committed, it names the
        newest state: a view of the round just closed would leave the workers to find the new
        state by their own seldom reads of LATEST."""
        if self.lease.generation is None:
            return
        try:
            state = max(state, self.run.latest())
            listed = self._written()
            close = self._existing_close(state)
        except Exception as exc:  # ending on a bucket error: the view still says so
            log.warning("round %d: its CLOSE unreadable (%s)", state, exc)
            listed, close = {}, None
        self._published = None  # an ending is always said
        self._publish(state, self.clock.time(), listed, close=close, ended=ENDED.get(reason, reason))
        self._release()

    def _release(self) -> None:
        try:
            self.lease.release()
        except Exception as exc:  # it expires on its own
            log.warning("the lease was not released (%s): it frees in %.0f s", exc, self.lease.ttl_s)
