"""The round engine: close a round when enough samples are in, reduce, apply, commit.

Its steps are plain calls that return data, so ``dedloc aggregate`` (``Scheduler.serve``) and the
Prefect round flow (``flows/pretraining.py``, which adds tasks, mapping, retries and artifacts)
drive the same loop::

    while stop_reason(snap := scheduler.poll(), until_state, deadline, clock.monotonic()) is None:
        close = snap.close or scheduler.wait_close(snap.state, deadline_of_the_wait)
        if close:  prepare(r); reduce_part(r, k) for every part; apply_part(r, k) ...; commit(r)

A round closes in ``try_close``: each new manifest validated (``shard.validate``), then the
round's admission rules (``admission.py``) over the validated shards, then CLOSE (``close.py``);
``finish`` reduces and applies it (``aggregator.py``) and commits it (``ledger.py``).

Everything it knows comes from the bucket, so it can be killed and started again anywhere: a
closed round is finished from its CLOSE marker, a half-applied state from its part markers, and
COMMIT is created at most once.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from ..storage.bucket import StorageError
from ..storage.layout import volunteer_of
from ..trust import identity
from . import admission, aggregator, heartbeat, verify, view
from .clock import Clock
from .close import Close, Rejection
from .ledger import commit
from .run import Run, RunError
from .shard import DataRef, Entry, Rejected, commit_hash, manifest_limit, validate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Opening:
    """What every shard of a round is judged against, read once per round."""

    at: float  # when the round opened: its state's COMMIT was written
    state_hash: str  # commit_hash of that COMMIT, which each shard must name
    ends: dict[str, int]  # where each stream was counted to (streams.json of the state)
    volunteers: frozenset[str]  # who contributed to that state


@dataclass(frozen=True)
class Snapshot:
    """One poll of a run: all the round loop decides on."""

    state: int  # the newest committed state; round ``state`` is the open one
    close: Close | None  # that round's CLOSE, once it is closed
    stopped: bool  # the organizer wrote the run's STOP marker


ENDED = {"rounds": "the scheduler reached its last round (--until-round)",
         "wall time": "the scheduler reached its wall time", "STOP marker": "the run is stopped (dedloc stop)"}


def stop_reason(snap: Snapshot, until_state: int | None = None, deadline: float | None = None,
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
    def __init__(self, run: Run, parallel: int = 2, poll_s: float | None = None, clock: Clock | None = None):
        """``poll_s`` fixes the seconds between polls; None follows the run's ``cadence``."""
        self.run, self.parallel, self.poll_s = run, parallel, poll_s
        self.clock = run.clock if clock is None else clock
        self._seen: dict[str, tuple[object, Entry | Rejection]] = {}  # manifest key -> (version, verdict)
        self._beats = heartbeat.Heartbeats()
        self._opened: dict[int, Opening] = {}
        self._started: dict[int, float] = {}  # round -> the first poll that saw work on it
        self._stopped = False  # STOP, as the last published view saw it
        self._eta: float | None = None  # the last published view's ETA: how soon to poll again
        self._speed = 0.0  # the live peers' speed, summed, when last known
        self._roster: identity.Roster | None = None  # the newest seen, from ROSTER.json or the history
        self._flags: dict[str, dict] = {}  # volunteer -> the validator's flag (verify.flagged)
        if run.signed:
            run.organizer("CLOSE")  # a scheduler that could not sign its CLOSEs fails here, not at the first

    def roster(self) -> identity.Roster | None:
        """The newest valid roster (runs with an organizer key). A changed roster clears every
        verdict (a revocation applies to shards not yet closed); a forged one, or an older
        version than one seen (a replay), is refused and the last good one kept. A scheduler
        starts from the newest version in the roster history, so a replay written before it
        started is refused too."""
        org = self.run.config.organizer_key
        if org is None:
            return None
        if self._roster is None:
            self._roster = identity.newest_roster(self.run.bucket, self.run.name, org)
        try:
            found = identity.read_roster(self.run.bucket, self.run.name, org)
        except identity.IdentityError as exc:
            log.error("%s; keeping roster version %s", exc, self._roster and self._roster.version)
            return self._roster
        if found is None or found == self._roster:
            return self._roster
        if self._roster is not None and found.version <= self._roster.version:
            log.error("refused roster version %d: version %d was seen (a replayed roster)",
                      found.version, self._roster.version)
            return self._roster
        self._roster, self._seen = found, {}
        log.info("roster version %d: %d volunteers, %d revoked keys", found.version,
                 len(found.volunteers), len(found.revoked))
        return found

    # closing
    def _verdicts(self, r: int, skip: set[str] = frozenset()) -> tuple[list[Entry], list[Rejection]]:
        """Validate every manifest of round r (each new one once); (accepted, rejected)."""
        bucket, keys = self.run.bucket, self.run.keys
        roster = self.roster()
        listed = {k: e for k, e in bucket.listing(keys.manifests_dir(r)).items() if keys.shard_of(k) not in skip}
        limit = manifest_limit(self.run.grad_format)

        def known(k: str, version: object) -> bool:
            return version is not None and self._seen.get(k, (None,))[0] == version

        # a manifest is read once per version (its ETag; where the store has none, its bytes)
        raw = {k: v for k, v in bucket.read_many([k for k, (n, tag) in listed.items()
                                                  if n <= limit and not known(k, tag)]).items() if v is not None}
        for k, (n, tag) in listed.items():
            if n > limit and not known(k, tag or ("size", n)):  # never read: it could be any size
                reason = f"manifest of {n} bytes, above {limit}"
                self._seen[k] = (tag or ("size", n), self._reject(r, keys.shard_of(k), reason))
        new = [k for k, v in raw.items() if not known(k, listed[k][1] or v)]
        if new:
            stored, opening = self._stored(r), self._opening(r)
            with ThreadPoolExecutor(2 * self.parallel) as pool:  # reads overlap; checks use every core
                check = lambda k: self._check(r, k, raw[k], roster, stored.get(keys.shard_of(k), {}), opening)  # noqa: E731
                for mkey, verdict in zip(new, pool.map(check, new)):
                    self._seen[mkey] = (listed[mkey][1] or raw[mkey], verdict)
        accepted, rejected = [], []
        for mkey in sorted(k for k in listed if k in self._seen):
            verdict = self._seen[mkey][1]
            (rejected if isinstance(verdict, Rejection) else accepted).append(verdict)
        return accepted, rejected

    def _stored(self, r: int) -> dict[str, dict[str, int]]:
        """The objects each shard of round r stores and their sizes, from one listing of them
        all (a LIST per 1000 objects, not one per shard)."""
        keys, stored = self.run.keys, {}
        for k, (n, _) in self.run.bucket.listing(keys.shards_dir(r)).items():
            shard = keys.shard_holding(r, k)
            stored.setdefault(shard, {})[k.removeprefix(shard + "/")] = n
        return stored

    def _opening(self, r: int) -> Opening:
        """What round r's shards are judged against (``Opening``): read once per round."""
        if r not in self._opened:
            commit = self.run.commit_of(r)
            ends = self.run.stream_ends(r)
            self._opened = {k: v for k, v in self._opened.items() if k >= r - 1}
            self._opened[r] = Opening(commit["committed_at"], commit_hash(commit), ends,
                                      frozenset(volunteer_of(p) for p in commit.get("contributors", [])))
            self._flags = verify.flagged(self.run)
        return self._opened[r]

    def _check(self, r: int, mkey: str, data: bytes, roster: identity.Roster | None,
               stored: dict[str, int], opening: Opening) -> Entry | Rejection:
        """The shard's verdict: its CLOSE entry, or why it is rejected (logged)."""
        shard = self.run.keys.shard_of(mkey)
        try:
            end = int(opening.ends.get(self.run.keys.shard_parts(shard)[1], 0))
            return validate(self.run, r, shard, data, roster, stored, opening.state_hash, end)
        except Rejected as exc:
            return self._reject(r, shard, str(exc), exc.data)
        except StorageError:
            raise  # the bucket's fault, not the shard's: a clear error, as everywhere
        except Exception as exc:  # whatever else one input makes happen rejects that input
            log.exception("round %d: shard %s could not be judged", r, shard)
            return self._reject(r, shard, f"could not be judged: {type(exc).__name__}: {exc}")

    @staticmethod
    def _logged(r: int, rejected: list[Rejection]) -> list[Rejection]:
        """Every rejection is logged as it is decided, naming the shard and why."""
        for x in rejected:
            log.warning("round %d: rejected shard %s: %s", r, x.key, x.reason)
        return rejected

    def _reject(self, r: int, shard: str, reason: str, data: DataRef | None = None) -> Rejection:
        """A CLOSE entry of a rejected shard; ``data``, the samples its own peer spent on it."""
        return self._logged(r, [Rejection(key=shard, reason=reason, data=data)])[0]

    def _late(self, r: int) -> list[Entry]:
        """Shards of round r-1 that missed its CLOSE, folded into round r (policy ``fold``)."""
        if r == 0 or self.run.config.close.late_shards != "fold":
            return []
        prev = Close.read(self.run, r - 1)
        late, _ = self._verdicts(r - 1, skip=prev.listed() if prev is not None else set())
        return admission.folded(late)

    def _admitted(self, r: int, accepted: list[Entry], live: frozenset[str],
                  now: float) -> tuple[admission.Weighed, list[Rejection]]:
        """The flagged volunteers' shards out, then the others weighed among the volunteers
        present (``admission.present``): (weighed, rejected). The flags are read as a
        round opens and again when it is about to close (one LIST), so a flag written mid-round
        keeps its volunteer out of that round's CLOSE."""
        accepted, flagged = admission.unflagged(accepted, self._flags)
        cfg, opening = self.run.config, self._opening(r)
        others = admission.present(live, opening.volunteers, opening.at, now, cfg.peer_timeout_s)
        weighed = admission.weigh(accepted, cfg.target_batch_size, cfg.close.max_share, others)
        return weighed, self._logged(r, flagged)

    def try_close(self, r: int, now: float | None = None) -> Close | None:
        """Write CLOSE for round r if its rule is met; the existing CLOSE if there is one. Either
        way, publish the round view (one PUT): what volunteers read instead of the bucket."""
        bucket, keys, rule = self.run.bucket, self.run.keys, self.run.config.close
        at = self.clock.time() if now is None else now
        close = self._existing_close(r)
        if close is not None:
            self._publish(r, at, close=close)
            return close
        self._forget_before(r - 1)
        cfg = self.run.config  # heartbeats first: with the manifests listed next, both as of `at`
        pending = self._beats.pending(bucket, keys, r, at, cfg.peer_timeout_s, cfg.target_batch_size,
                                      cfg.cadence.heartbeat_max_s)
        accepted, rejected = self._verdicts(r)
        accepted, extra = admission.bound_parts(accepted + self._late(r), rule.max_parts)
        accepted, screened = admission.screen(accepted, cfg.norm_screen)
        rejected += self._logged(r, extra + screened)
        live = self._enrolled(pending.volunteers)
        now = self.clock.time() if now is None else now
        (accepted, samples, cap), flagged = self._admitted(r, accepted, live, now)
        rejected += flagged
        target = cfg.target_batch_size
        opened = self._opening(r).at
        if pending.peers or accepted:  # a round's time runs from its first work, not an idle opening
            self._started.setdefault(r, max(opened, at))
        expired = admission.timed_out(opened, now, rule.timeout_s)
        if admission.met(samples, target, rule.min_fraction, expired):  # flags written since the round opened count too
            self._flags = verify.flagged(self.run)
            (accepted, samples, cap), flagged = self._admitted(r, accepted, live, now)
            rejected += flagged
        if not admission.met(samples, target, rule.min_fraction, expired):
            self._publish(r, at, samples=samples, shards=len(accepted), rejected=len(rejected), pending=pending,
                          cap=cap)
            return None
        roster = self._roster.version if self._roster is not None else None
        close = Close(round=r, samples=samples, target=target, accepted=sorted(accepted, key=lambda s: s.key),
                      roster=roster, rejected=sorted(rejected, key=lambda s: s.key), opened_at=opened,
                      started_at=self._started.get(r), closed_at=now,
                      reason="target" if samples >= target else "timeout")
        if not bucket.create_json(keys.close(r), self.run.record(f"CLOSE of round {r}", close.dump())):
            log.info("round %d was closed by another scheduler", r)
        close = Close.read(self.run, r)
        log.info("round %d closed: %d samples from %d shards (%d rejected)", r, close.samples,
                 len(close.accepted), len(close.rejected))
        self._publish(r, at, close=close)
        return close

    def _enrolled(self, volunteers: frozenset[str]) -> frozenset[str]:
        """The heartbeating volunteers that count: in a signed run, only enrolled ones (a
        heartbeat is unsigned, and anyone able to write one could otherwise lower every cap)."""
        if not self.run.signed:
            return volunteers
        return frozenset(v for v in volunteers if self._roster is not None and v in self._roster.volunteers)

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

    def _publish(self, r: int, at: float, samples: int = 0, shards: int = 0, rejected: int = 0,
                 pending: heartbeat.Pending = heartbeat.Pending(), close: Close | None = None,
                 cap: int | None = None, ended: str | None = None) -> None:
        """Write the round view of open round r (closed: from its CLOSE, no heartbeats). A failed
        write is logged, never raised: volunteers treat a view gone stale as no view."""
        bucket, keys, target = self.run.bucket, self.run.keys, self.run.config.target_batch_size
        if close is not None:
            samples, shards, rejected = close.samples, len(close.accepted), len(close.rejected)
        if pending.samples_per_s > 0:
            self._speed = pending.samples_per_s
        # before a new round's first heartbeats, the collaboration's last known speed
        self._eta = view.eta(target, samples, pending.samples, pending.samples_per_s or self._speed, close is not None)
        try:
            self._stopped = bucket.exists(keys.stop())
            v = view.View(state=r, round=r, target=target, validated_samples=samples, shards=shards,
                          rejected=rejected, pending_samples=pending.samples, peers=pending.peers,
                          samples_per_s=pending.samples_per_s, ignored_heartbeats=pending.ignored,
                          horizon_s=pending.horizon_s, closed=close is not None, stopped=self._stopped,
                          eta_s=self._eta, cap=cap, ended=ended, at=at,
                          written_at=max(at, self.clock.time()))
            view.write(bucket, keys, v)
        except Exception as exc:
            log.warning("round %d: the round view was not published (%s)", r, exc)

    def _forget_before(self, r: int) -> None:
        """Drop verdicts of rounds before r: never asked again (round r+1 folds round r's late
        shards, so round r's stay). Bounds the cache of a scheduler served for weeks."""
        keys = self.run.keys
        self._seen = {k: v for k, v in self._seen.items() if keys.round_of(k) >= r}
        self._started = {k: v for k, v in self._started.items() if k >= r}

    # the loop's steps
    def poll(self) -> Snapshot:
        """The run as the round loop sees it now."""
        r = self.run.latest()
        return Snapshot(state=r, close=self._existing_close(r),
                        stopped=self.run.bucket.exists(self.run.keys.stop()))

    def wait_close(self, r: int, deadline: float | None = None) -> Close | None:
        """Poll until round r closes (its CLOSE); None once the run is stopped or ``deadline``
        (``clock.monotonic()``) passes, so the loop can check its stop rules again. By default
        it polls every ``cadence.scheduler_poll_s``, faster near the target: each poll reads
        only the heartbeats and manifests written since the last one."""
        while True:
            close = self.try_close(r)
            if close is not None:
                return close
            if self._stopped:
                return None
            if deadline is not None and self.clock.monotonic() > deadline:
                return None
            wait = self.run.config.cadence.scheduler_s(self._eta) if self.poll_s is None else self.poll_s
            self.clock.sleep(wait if deadline is None else max(0.0, min(wait, deadline - self.clock.monotonic())))

    def finish(self, r: int, pool: Executor) -> dict:
        """Reduce, apply and commit closed round r, parts in parallel on ``pool``; safe to repeat
        after any crash. The Prefect round flow runs the same four steps as tasks."""
        run = self.run
        aggregator.prepare(run, r)
        parts = range(run.n_parts)
        list(pool.map(lambda k: aggregator.reduce_part(run, r, k), parts))
        list(pool.map(lambda k: aggregator.apply_part(run, r, k), parts))
        return commit(run, r)

    def step(self, pool: Executor) -> bool:
        """One unit of progress; False when the open round is still filling."""
        r = self.run.latest()
        if self.try_close(r) is None:
            return False
        self.finish(r, pool)
        return True

    def serve(self, until_round: int | None = None, max_wait_s: float | None = None) -> int:
        """Schedule rounds until state ``until_round`` is committed, or the run is stopped (a
        round already closed is still committed), or forever; a round that does not fill
        within ``max_wait_s`` raises TimeoutError."""
        snap = None
        try:
            with ThreadPoolExecutor(self.parallel) as pool:
                while (reason := stop_reason(snap := self.poll(), until_round)) is None:
                    wait = None if max_wait_s is None else self.clock.monotonic() + max_wait_s
                    close = snap.close or self.wait_close(snap.state, wait)
                    if close is not None:
                        self.finish(snap.state, pool)
                    elif wait is not None and self.clock.monotonic() > wait:
                        raise TimeoutError(f"round {snap.state} did not fill within {max_wait_s:.0f}s")
        except BaseException as exc:  # Ctrl-C, or a failure the loop cannot go on from
            if snap is not None:
                self.end(snap.state, f"the scheduler exited ({type(exc).__name__}: {str(exc)[:120]})")
            raise
        self.end(snap.state, reason)
        if reason == "STOP marker":
            log.info("run %s stopped at state %d", self.run.name, snap.state)
        return snap.state

    def end(self, state: int, reason: str) -> None:
        """Say in the round view that no scheduler will close round ``state`` (``reason``: what
        ended the loop), so workers stop computing for it; the next scheduler's view replaces it."""
        try:
            close = self._existing_close(state)
        except Exception as exc:  # ending on a bucket error: the view still says so
            log.warning("round %d: its CLOSE unreadable (%s)", state, exc)
            close = None
        self._publish(state, self.clock.time(), close=close, ended=ENDED.get(reason, reason))
