"""The scheduler's judgement of a round's shards: every manifest validated once per version.

A round is judged against what opened it (``Opening``: its COMMIT, the streams it counted, who
contributed), the roster (signed runs) and the validator's flags. Each manifest the round's
listing shows is read and validated (``validation.validate``) once per version (its ETag), so a
poll where nothing changed reads nothing; a changed roster clears every verdict, since a
revocation applies to shards not yet closed. Then the admission rules (``admission.py``)
weigh what was accepted among the volunteers present. The scheduler (``scheduler.py``) decides
from the result when to write CLOSE.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..checks import admission, catalog, direction, flags
from ..checks.probe import LossProbe
from ..checks.validation import OutOfBounds, check_contents, manifest_limit
from ..protocol.close import Close, Rejection, amend
from ..protocol.run import Run, RunError
from ..protocol.shard import DataRef, Entry, Rejected, commit_hash
from ..storage import codec, vector
from ..storage.bucket import StorageError
from ..storage.layout import volunteer_of
from ..trust import identity

log = logging.getLogger(__name__)

Listing = dict[str, tuple[int, str | None]]  # key -> (size, version tag): Bucket.listing


@dataclass(frozen=True)
class Opening:
    """What every shard of a round is judged against, read once per round."""

    at: float  # when the round opened: its state's COMMIT was written
    state_hash: str  # commit_hash of that COMMIT, which each shard must name
    ends: dict[str, int]  # where each stream was counted to (streams.json of the state)
    volunteers: frozenset[str]  # who contributed to that state


class Judge:
    def __init__(self, run: Run, parallel: int = 2, defer: bool = False) -> None:
        """``defer``: while two volunteers or more offer to aggregate a round, its shards'
        contents are left for them to check after CLOSE (checks/exchange.py): a shard is admitted on
        its manifest and its objects' sizes, and copied to its frozen key server-side, unread."""
        self.run, self.parallel, self.defer = run, parallel, defer
        self.seen: dict[str, tuple[object, Entry | Rejection]] = {}  # manifest key -> (version, verdict)
        self._opened: dict[int, Opening] = {}
        self._roster: identity.Roster | None = None  # the newest seen, from ROSTER.json or the history
        self._flags: dict[str, flags.Flag] = {}  # volunteer -> its flag (checks/flags.py)
        self._closes: dict[int, Close] = {}  # previous rounds' CLOSEs, which never change
        self._missed: dict[str, Rejection | None] = {}  # round r-1's manifests that missed its CLOSE -> spent
        self._resketched: dict[tuple[str, int], object] = {}  # late diloco shards' sketches on round r's chunks
        probe = run.config.close.probe_samples
        self.probe = LossProbe(run, probe) if run.config.algorithm == "diloco" and probe else None

    def roster(self) -> identity.Roster | None:
        """The newest valid roster (runs with an organizer key). A forged one, or an older
        version than one seen (a replay), is refused and the last good one kept. A judge starts
        from the newest version in the roster history, so a replay written before it started is
        refused too, and never from one older than the newest CLOSE used (RunError): versions
        deleted from the history would otherwise undo a revocation."""
        org = self.run.config.organizer_key
        if org is None:
            return None
        if self._roster is None:
            self._roster = identity.newest_roster(self.run.bucket, self.run.name, org)
            self._check_not_rewound()
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
        self._roster, self.seen = found, {}
        log.info("roster version %d: %d volunteers, %d revoked keys", found.version,
                 len(found.volunteers), len(found.revoked))
        return found

    def _check_not_rewound(self) -> None:
        """RunError if the roster history is older than the version the newest CLOSE was judged with."""
        s = self.run.latest()
        for r in (s, s - 1):
            try:
                close = Close.read(self.run, r) if r >= 0 else None
            except identity.IdentityError:  # a forged CLOSE: the scheduler deletes it, nothing to learn
                continue
            if close is None or close.roster is None:
                continue
            have = self._roster.version if self._roster is not None else None
            if have is None or have < close.roster:
                raise RunError(f"run {self.run.name!r}: the newest roster in the bucket is version {have}, but "
                               f"round {r} was closed with version {close.roster}: roster versions were deleted, "
                               f"which would undo revocations. Restore {self.run.keys.roster_version(close.roster)} "
                               "(the organizer keeps the roster history) before scheduling")
            return

    @property
    def flags(self) -> dict[str, flags.Flag]:
        """The flagged volunteers as last read (as the round opened, or about to close)."""
        return self._flags

    @property
    def roster_version(self) -> int | None:
        return self._roster.version if self._roster is not None else None

    def verdicts(self, r: int, listed: Listing | None = None,
                 skip: set[str] = frozenset()) -> tuple[list[Entry], list[Rejection]]:
        """Validate every manifest of round r that ``listed`` (the volunteers' listing:
        ``Run.written``; None: list it) shows, each new version once; (accepted, rejected). The
        roster is read only when there is something new to judge."""
        bucket, keys = self.run.bucket, self.run.keys
        listed = self.run.written()[0] if listed is None else listed
        manifests = {k: listed[k] for k in keys.of_round(listed, r, "manifest") if keys.shard_of(k) not in skip}
        limit = manifest_limit(self.run.grad_format)

        def known(k: str, version: object) -> bool:
            return version is not None and self.seen.get(k, (None,))[0] == version

        fresh = any(not known(k, tag or ("size", n)) for k, (n, tag) in manifests.items())
        roster = self.roster() if fresh else self._roster  # a changed roster clears every verdict
        # a manifest is read once per version (its ETag; where the store has none, its bytes)
        raw = {k: v for k, v in bucket.read_many([k for k, (n, tag) in manifests.items()
                                                  if n <= limit and not known(k, tag)]).items() if v is not None}
        for k, (n, tag) in manifests.items():
            if n > limit and not known(k, tag or ("size", n)):  # never read: it could be any size
                reason = f"manifest of {n} bytes, above {limit}"
                self.seen[k] = (tag or ("size", n), self.reject(r, keys.shard_of(k), reason))
        new = [k for k, v in raw.items() if not known(k, manifests[k][1] or v)]
        if new:
            stored, opening = self._stored(r, listed), self.opening(r)
            contents = not (self.defer and len(self.aggregators(r, listed, roster)) >= 2)
            with ThreadPoolExecutor(2 * self.parallel) as pool:  # reads overlap; checks use every core
                check = lambda k: self._check(r, k, raw[k], roster, stored.get(keys.shard_of(k), {}), opening,  # noqa: E731
                                              contents)
                for mkey, verdict in zip(new, pool.map(check, new)):
                    self.seen[mkey] = (manifests[mkey][1] or raw[mkey], verdict)
        accepted, rejected = [], []
        for mkey in sorted(k for k in manifests if k in self.seen):
            verdict = self.seen[mkey][1]
            (rejected if isinstance(verdict, Rejection) else accepted).append(verdict)
        return accepted, rejected

    def landed(self, accepted: list[Entry], rejected: list[Rejection]) -> dict[str, int]:
        """The samples of each peer's manifests among ``verdicts``' answer, accepted or not:
        what that peer's heartbeat stops counting as pending once its shards land."""
        out: dict[str, int] = {}
        for x in [*accepted, *rejected]:
            samples = x.samples if isinstance(x, Entry) else sum(n for _, n in x.data.ranges) if x.data else 0
            peer = self.run.keys.shard_parts(x.key)[1]
            out[peer] = out.get(peer, 0) + samples
        return out

    def _stored(self, r: int, listed: Listing) -> dict[str, dict[str, int]]:
        """The objects each shard of round r stores and their sizes, from the volunteers'
        listing (a LIST per 1000 objects, not one per shard)."""
        keys, stored = self.run.keys, {}
        for k in keys.of_round(listed, r, "object"):
            shard = keys.shard_holding(k)
            stored.setdefault(shard, {})[k.removeprefix(shard + "/")] = listed[k][0]
        return stored

    def opening(self, r: int) -> Opening:
        """What round r's shards are judged against (``Opening``): read once per round, with
        the validator's flags."""
        if r not in self._opened:
            commit = self.run.commit_of(r)
            ends = self.run.stream_ends(r)
            self._opened = {k: v for k, v in self._opened.items() if k >= r - 1}
            self._opened[r] = Opening(commit["committed_at"], commit_hash(commit), ends,
                                      frozenset(volunteer_of(p) for p in commit.get("contributors", [])))
            self._flags = flags.read(self.run)
        return self._opened[r]

    def aggregators(self, r: int, listed: Listing, roster: identity.Roster | None) -> set[str]:
        """The volunteers whose offers to aggregate round r ``listed`` shows, the roster letting
        them and no flag shutting them out (not yet read: CLOSE reads them, ``referee.Referee``)."""
        keys = self.run.keys
        offered = {keys.written(k).peer for k in keys.of_round(listed, r, "offer")}
        return {roster.person(p) for p in offered if roster is not None and roster.may_aggregate(p)
                and flags.flag_of(p, self._flags, roster) is None}

    def _check(self, r: int, mkey: str, data: bytes, roster: identity.Roster | None,
               stored: dict[str, int], opening: Opening, contents: bool = True) -> Entry | Rejection:
        """The shard's verdict: its CLOSE entry, or why it is rejected (logged); ``contents``
        False: admitted unread (``defer``)."""
        shard = self.run.keys.shard_of(mkey)
        try:
            end = int(opening.ends.get(self.run.keys.shard_parts(shard)[1], 0))
            return catalog.validate(self.run, r, shard, data, roster, stored, opening.state_hash, end,
                                    self._inspector(r), contents)
        except Rejected as exc:
            if isinstance(exc, OutOfBounds):
                flags.out_of_bounds(self.run, r, shard, str(exc))
            return self.reject(r, shard, str(exc), exc.data)
        except StorageError:
            raise  # the bucket's fault, not the shard's: a clear error, as everywhere
        except Exception as exc:  # whatever else one input makes happen rejects that input
            log.exception("round %d: shard %s could not be judged", r, shard)
            return self.reject(r, shard, f"could not be judged: {type(exc).__name__}: {exc}")

    def _inspector(self, r: int):
        """The local-steps mode's screens of a shard's values as validation reads them (never
        recomputed before CLOSE): its sketch, for the direction screen, and whether it
        descends the loss of its own samples (``probe.py``)."""
        if self.run.config.algorithm != "diloco":
            return None
        fmt, least = self.run.grad_format, self.run.config.close.min_descent

        def inspect(entry: Entry, arrays) -> None:
            entry._sketch = direction.sketch(fmt, arrays, direction.sampled(fmt.n_chunks, r))
            if self.probe is not None:
                z = self.probe.descent(entry, codec.decode(arrays, fmt.codec, fmt.block, fmt.n))
                if not z >= least:
                    raise Rejected(f"does not descend the loss of the samples it claims: its cosine with their "
                                   f"gradient is {z:.3g} times a random direction's spread, below "
                                   f"close.min_descent={least:g}")
        return inspect

    def contents(self, close: Close) -> Close:
        """``close`` with the contents of the shards it admitted unread checked here (each read
        whole: ``validation.check_contents``), as when no volunteer aggregators are left to check them: those
        refused, above the norm bound or the norm screen's, rejected (logged)."""
        verdicts: dict[str, float | str] = {}

        def check(e: Entry) -> None:
            try:
                verdicts[e.key] = check_contents(self.run, self.run.keys.frozen(e.key), e.checksums)[1]
            except Rejected as exc:
                verdicts[e.key] = str(exc)
                if isinstance(exc, OutOfBounds):
                    flags.out_of_bounds(self.run, close.round, e.key, str(exc))
        with ThreadPoolExecutor(2 * self.parallel) as pool:
            list(pool.map(check, [e for e in close.accepted if e.norm is None]))
        cfg = self.run.config
        kept, out = admission.judge_contents(close.accepted, verdicts, cfg.max_grad_norm, cfg.norm_screen)
        return amend(close, kept, self.logged(close.round, out))

    @staticmethod
    def logged(r: int, rejected: list[Rejection]) -> list[Rejection]:
        """Every rejection is logged as it is decided, naming the shard and why."""
        for x in rejected:
            log.warning("round %d: rejected shard %s: %s", r, x.key, x.reason)
        return rejected

    def reject(self, r: int, shard: str, reason: str, data: DataRef | None = None) -> Rejection:
        """A CLOSE entry of a rejected shard; ``data``, the samples its own peer spent on it."""
        return self.logged(r, [Rejection(key=shard, reason=reason, data=data)])[0]

    def closed(self, close: Close) -> None:
        """A CLOSE this scheduler wrote or read: the next round tells round r's late shards by it."""
        self._closes = {close.round: close}

    def _previous(self, r: int) -> Close | None:
        """Round r-1's CLOSE (one GET, only where this scheduler did not write it)."""
        if r - 1 not in self._closes:
            prev = Close.read(self.run, r - 1)
            if prev is None:
                return None
            self._closes = {r - 1: prev}
        return self._closes[r - 1]

    def missed(self, r: int, listed: Listing) -> list[Rejection]:
        """Shards of round r-1 that missed its CLOSE, under the policy ``reject``: never counted,
        but the samples a manifest names, once it is its peer's own (``catalog.spent``), are
        spent: round r's CLOSE lists it (``missed``) with them, so its stream moves past them and an
        honest worker whose shard missed a round is not refused later for the gap it left
        (``validation.stream_window``). One GET a late manifest, once."""
        if r == 0 or self.run.config.close.late_shards != "reject" or (prev := self._previous(r)) is None:
            return []
        keys, skip = self.run.keys, prev.listed()
        manifests = [k for k in keys.of_round(listed, r - 1, "manifest") if keys.shard_of(k) not in skip]
        self._missed = {k: v for k, v in self._missed.items() if k in manifests}
        new = [k for k in manifests if k not in self._missed and listed[k][0] <= manifest_limit(self.run.grad_format)]
        if new:
            roster = self.roster()
            for k, raw in self.run.bucket.read_many(new).items():
                data = catalog.spent(self.run, r - 1, keys.shard_of(k), raw, roster) if raw is not None else None
                self._missed[k] = None if data is None else Rejection(
                    key=keys.shard_of(k), data=data, reason=f"missed the CLOSE of round {r - 1} "
                    "(close.late_shards=reject): not counted, its samples spent")
        return [x for k in manifests if (x := self._missed.get(k)) is not None]

    def late(self, r: int, listed: Listing) -> list[Entry]:
        """Shards of round r-1 that missed its CLOSE, folded into round r (policy ``fold``), from
        the volunteers' listing ``listed``."""
        if r == 0 or self.run.config.close.late_shards != "fold" or self._previous(r) is None:
            return []
        skip = self._closes[r - 1].listed()
        late, _ = self.verdicts(r - 1, listed, skip=skip)
        folded = admission.folded(late)
        fmt = self.run.grad_format
        chunks = direction.sampled(fmt.n_chunks, r)
        for e in folded:  # sketched again on round r's chunks (once), to compare with round r's shards
            if e._sketch is not None and chunks != direction.sampled(fmt.n_chunks, r - 1):
                if (e.key, r) not in self._resketched:
                    raw = vector.read_vector(self.run.bucket, self.run.keys.frozen(e.key), fmt, raw=True)
                    self._resketched = {k: v for k, v in self._resketched.items() if k[1] >= r}
                    self._resketched[e.key, r] = direction.sketch(fmt, raw, chunks)
                e._sketch = self._resketched[e.key, r]
        return folded

    def admitted(self, r: int, accepted: list[Entry], live: frozenset[str], now: float,
                 started_at: float | None = None,
                 reread_flags: bool = False) -> tuple[admission.Weighed, list[Rejection]]:
        """The close's checks over round r's validated shards (``catalog.admit``), then those
        kept weighed among the volunteers present (``admission.present_volunteers``), at least as many as
        a signed run's first round awaits (``admission.least_volunteers``, from its first work at
        ``started_at``): (weighed, rejected). The flags are read as a round opens and again when
        it is about to close (``reread_flags``: one LIST), so a flag written mid-round keeps its
        volunteer out of that round's CLOSE."""
        if reread_flags:
            self._flags = flags.read(self.run)
        cfg, opening = self.run.config, self.opening(r)
        accepted, rejected = catalog.admit(accepted, catalog.Round(cfg, self._flags, self._roster))
        others = admission.present_volunteers(live, opening.volunteers, opening.at, now, cfg.peer_timeout_s)
        enrolled = len(self._roster.volunteers) if self._roster is not None else 0
        since = opening.at if started_at is None else started_at
        least = admission.least_volunteers(opening.volunteers, enrolled, since, now, cfg.peer_timeout_s)
        return admission.weigh(accepted, cfg.target_batch_size, cfg.close.max_share, others, least), rejected

    def enrolled(self, volunteers: frozenset[str]) -> frozenset[str]:
        """The heartbeating volunteers that count: in a signed run, only enrolled ones (a
        heartbeat is unsigned, and anyone able to write one could otherwise lower every cap)."""
        if not self.run.signed:
            return volunteers
        return frozenset(v for v in volunteers if self._roster is not None and v in self._roster.volunteers)

    def forget_before(self, r: int) -> None:
        """Drop verdicts of rounds before r: never asked again (round r+1 folds round r's late
        shards, so round r's stay). Bounds the cache of a scheduler served for weeks."""
        keys = self.run.keys
        self.seen = {k: v for k, v in self.seen.items() if keys.round_of(k) >= r}
