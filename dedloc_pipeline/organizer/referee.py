"""The scheduler's side of checked aggregation (``exchange.py``, docs/aggregators.md): which
offers count, and how a closed round settles through its exchanges (the shards' checks, LAMB's
partial sums, the answers): wait for the claims, seal them, say in the round view what may be
revealed, settle each part two aggregators agree on, record what the next exchange takes, and
flag whoever lied.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..checks import admission, audit, draw, exchange, flags
from ..checks.exchange import (
    PARTS,
    SCREEN,
    SUMS,
    Claim,
    Offer,
    Result,
    Screen,
    Stage,
    Sums,
    digest,
    fingerprints,
    read_signed,
)
from ..checks.flags import WRONG_PART, Flag, flag_of, raise_flag
from ..compute import aggregation, optim
from ..protocol.clock import Clock
from ..protocol.close import Close
from ..protocol.run import Run
from ..storage.layout import volunteer_of
from . import standing
from .standing import Standing

log = logging.getLogger(__name__)


@dataclass
class Settlement:
    """How round r's parts were settled: by the two aggregators (``agreed``), or left to the
    organizer (``left``, why), with every result revealed (for the flags after)."""

    agreed: dict[int, list[str]] = field(default_factory=dict)
    left: dict[int, str] = field(default_factory=dict)
    results: dict[tuple[int, str], Result] = field(default_factory=dict)
    screened: dict[int, list[str]] = field(default_factory=dict)  # parts whose checks of the shards two agreed on
    screens: dict[tuple[int, str], Screen] = field(default_factory=dict)
    summed: dict[int, list[str]] = field(default_factory=dict)  # LAMB: parts whose sums two agreed on
    sums: dict[tuple[int, str], Sums] = field(default_factory=dict)
    fingerprints: dict[tuple[int, str], dict[str, str]] = field(default_factory=dict)
    liars: dict[str, str] = field(default_factory=dict)  # peer -> why, found without the organizer's answer
    withheld: dict[str, str] = field(default_factory=dict)  # peer -> the answer it owed and never revealed
    audits: list[dict] = field(default_factory=list)  # each agreement audited: stage, part, chunks, by, found


BENCHED_ROUNDS = 10  # rounds an aggregator that withheld an answer is not assigned, and every part is
# audited whole after a lie was caught
TRUSTED_AFTER = 8  # parts a volunteer's aggregators must have passed audits for before an audit samples theirs
REVEAL_POLLS = 4  # the least time, in the scheduler's polls, an aggregator has to reveal what it claimed


class Referee:
    """The scheduler's side: which offers count, and how a closed round's parts settle."""

    def __init__(self, run: Run, clock: Clock, poll_s: float = 2.0, parallel: int = 2,
                 renew: Callable[[], None] = lambda: None):
        """``renew``: what keeps this scheduler's lease while it waits for the aggregators (a wait
        of ``close.aggregate_s`` may outlast the lease: a standby must not take a live run)."""
        self.run, self.clock, self.poll_s, self.parallel, self.renew = run, clock, poll_s, parallel, renew
        self._standing: Standing | None = None  # read at first need (one GET), written when a round changed it
        self._secret: tuple[int, str] | None = None  # the round's draw (``audit.secret``), once made

    @property
    def standing(self) -> Standing:
        if self._standing is None:
            self._standing = standing.read(self.run)
        return self._standing

    def offers(self, r: int, listed: dict, roster, flagged: dict) -> list[str]:
        """The peers whose offers for round r are in ``listed``, signed, of volunteers the
        roster lets aggregate and no flag shuts out, under any name, nor a recent withholding
        (one GET an offer)."""
        out = []
        for key in self.run.keys.of_round(listed, r, "offer"):
            peer = self.run.keys.written(key).peer
            if roster is None or not roster.may_aggregate(peer) or flag_of(peer, flagged, roster) is not None:
                continue
            if self.standing.benched.get(roster.person(peer), -1) >= r:
                continue
            if read_signed(self.run, key, Offer, roster, f"offer {key}", listed, round=r, peer=peer) is not None:
                out.append(peer)
        return out

    def settle(self, close: Close, roster, reveal: Callable[[str], None]) -> Settlement:
        """Settle round ``close.round``'s parts that its aggregators agree on by ``close.aggregate_by``
        (the run's clock), calling ``reveal(stage)`` when the round view is to say what they may
        show: first the exchanges before the answers' (the checks of the shards, ``_screen``; LAMB's
        partial sums, ``_norms``), each in its share of the time left, each leaving the organizer
        the parts it did not settle, then the answers', the organizer computing each part left to
        it as soon as it is, while the others are answered."""
        run, r, keys = self.run, close.round, self.run.keys
        out, kept = Settlement(), self.standing.model_copy(deep=True)
        for key in run.bucket.listing(keys.applied_dir(r + 1)):  # parts settled before a restart
            if (k := keys.applied_part(r + 1, key)) is not None and k < len(close.aggregators):
                out.agreed[k] = close.aggregators[k]
        start, parts = close.closed_at, list(range(len(close.aggregators)))
        before = exchange.stages(close, run)[:-1]  # the exchanges before the answers'
        for i, stage in enumerate(before):  # the time left is shared among the exchanges left
            by = start + (close.aggregate_by - start) / (len(before) + 1 - i)
            start, kept = (self._screen if stage is SCREEN else self._norms)(close, roster, reveal, out, parts,
                                                                              start, by)
            for k in set(parts) - set(kept):
                out.left[k] = f"its {stage.noun} were the organizer's"
            parts = kept
        answering = [k for k in parts if k not in out.agreed]
        with ThreadPoolExecutor(self.parallel) as pool:
            early: dict[int, Future] = {}

            def compute_left() -> None:
                """The parts left to the organizer so far, computed at once while the others are answered."""
                for k in sorted(set(out.left) - set(early)):
                    early[k] = pool.submit(self._compute, r, k)

            def try_part(k: int, listed: dict, claims: dict) -> None:
                self._try(close, k, listed, roster, claims, out)
                compute_left()
            compute_left()
            listed = self._exchange(close, PARTS, answering, start, close.aggregate_by, roster, reveal, try_part,
                                    lambda k: k in out.agreed or k in out.left,
                                    lambda k, why: (out.left.setdefault(k, why), compute_left()), out)
            for future in early.values():
                future.result()
        for k in range(len(close.aggregators)):
            if k not in out.agreed:
                out.left.setdefault(k, "no agreement by the deadline")
                log.warning("round %d: part %d left to the organizer: %s", r, k, out.left[k])
        self._bench(close, [k for k in answering if k not in out.agreed], roster, listed, out)
        if out.audits:
            run.bucket.write_json(keys.audits(r), run.record(f"audits of round {r}", {
                "round": r, "secret": self._drawn_by(close), "fraction": run.config.close.audit,
                "audits": out.audits}, round=r))
        self.standing.benched = {p: until for p, until in self.standing.benched.items() if until > r}  # served
        standing.keep(self.run, self.standing, before=kept)
        return out

    def _compute(self, r: int, k: int) -> None:
        """Part k of state r+1 as the organizer computes it (what ``close_out`` would, later)."""
        aggregation.reduce_part(self.run, r, k)
        aggregation.apply_part(self.run, r, k)

    def _drawn_by(self, close: Close) -> str:
        if self._secret is None or self._secret[0] != close.round:
            self._secret = (close.round, audit.secret(self.run, close))
        return self._secret[1]

    def _audited(self, close: Close, stage: Stage, k: int, roster, check: Callable[[list[int]], str | None],
                 out: Settlement) -> bool:
        """Whether part k's agreement in ``stage`` passes its audit (``audit.py``): ``check`` of the
        chunks drawn, all of them where an aggregator's volunteer has not passed ``TRUSTED_AFTER``
        audits yet, after a caught lie, or where a coordinate's value takes the whole part's
        (``centered_clip``). A failed one flags both aggregators and audits every part whole for
        ``BENCHED_ROUNDS`` rounds."""
        run, r, peers = self.run, close.round, close.aggregators[k]
        person = (lambda p: roster.person(p)) if roster is not None else (lambda p: p)
        held = self.standing
        whole = (r <= held.alert_until or run.config.aggregation == "centered_clip"
                 or any(held.passed.get(person(p), 0) < TRUSTED_AFTER for p in peers))
        chunks = draw.draw(self._drawn_by(close), k, run.part_chunks(k), 1.0 if whole else run.config.close.audit)
        found = check(chunks)
        out.audits.append({"stage": stage.reveal, "part": k, "chunks": chunks, "by": list(peers), "found": found})
        if found is None:
            for p in {person(p) for p in peers}:
                held.passed[p] = held.passed.get(p, 0) + 1
            return True
        for peer in peers:
            out.liars[peer] = f"the organizer's audit of part {k} of round {r} ({stage.noun}): {found}"
        held.alert_until = r + BENCHED_ROUNDS
        log.warning("round %d: the audit of part %d's %s agreed by %s found a lie (%s): every part audited whole "
                    "until round %d", r, k, stage.noun, " and ".join(peers), found, held.alert_until)
        return False

    def _bench(self, close: Close, unsettled: list[int], roster, listed: dict, out: Settlement) -> None:
        """An aggregator given one of the ``unsettled`` parts that never revealed an answer for it
        (claimed and withheld, or never claimed) withheld it (``_withheld``); what revealed: the
        exchange's last listing (one GET of the sealed claims, only when a part went unsettled)."""
        if not unsettled:
            return
        r, keys, claims = close.round, self.run.keys, self._sealed(close, PARTS)
        for k in unsettled:
            for peer in close.aggregators[k]:
                if keys.result(r, peer, k) in listed or peer in out.liars or peer in out.withheld:
                    continue
                claimed = claims is not None and (k, peer) in claims
                self._withheld(close, peer, f"{'claimed' if claimed else 'was given'} part {k} of round {r} and "
                               "never revealed", roster, out)

    def _withheld(self, close: Close, peer: str, why: str, roster, out: Settlement) -> None:
        """``peer`` owed a result and did not reveal it in time: it sits the next ``BENCHED_ROUNDS``
        rounds out (its person, kept in the standing: a restarted scheduler benches it too); a
        withheld answer holds its part up, and is no lie to flag."""
        r = close.round
        out.withheld[peer] = why
        self.standing.benched[roster.person(peer) if roster is not None else peer] = r + BENCHED_ROUNDS
        log.warning("round %d: aggregator %s %s: not assigned until round %d", r, peer, why, r + BENCHED_ROUNDS + 1)

    def _exchange(self, close: Close, stage: Stage, parts: list[int], start: float, by: float, roster,
                  reveal: Callable[[str], None], try_part: Callable, decided: Callable[[int], bool],
                  leave: Callable[[int, str], None], out: Settlement) -> dict:
        """One ``stage`` of ``parts``, from ``start`` to ``by``: wait for their aggregators'
        claims; once all are in or half the time is out, read and seal them and ``reveal``; then
        ``try_part`` each part not yet ``decided``, polling, until all are or ``by`` passes. A
        result is an upload of what was claimed: one not revealed within as long as the claims
        took (``REVEAL_POLLS`` polls at least) is withheld (``_withheld``), and its part is
        ``leave``-d to the organizer then, not at ``by``. Its last listing of the volunteers' prefixes."""
        if not parts:
            return {}
        run, r, keys = self.run, close.round, self.run.keys
        claims, reveal_by = self._sealed(close, stage), by
        if claims is not None:  # sealed before a restart: the answers may be revealed already, and are again
            reveal(stage.reveal)
            reveal_by = min(by, self.clock.time() + REVEAL_POLLS * self.poll_s)
        wanted = {(k, p) for k in parts for p in close.aggregators[k]}
        half = start + (by - start) / 2
        while True:
            listed, _ = run.written()
            now = self.clock.time()
            if claims is None:
                claimed = {(int(w.part), w.peer) for key in keys.of_round(listed, r, stage.claim_kind)
                           if (w := keys.written(key))}
                if wanted <= claimed or now >= half:
                    # read and sealed before anyone may reveal: a claim written after could copy an answer
                    claims = self._seal(close, stage, sorted(wanted & claimed), listed, roster)
                    reveal(stage.reveal)
                    reveal_by = min(by, now + max(now - start, REVEAL_POLLS * self.poll_s))
            if claims is not None:
                for k in parts:
                    if not decided(k):
                        try_part(k, listed, claims)
                for k in [k for k in parts if not decided(k)] if now >= reveal_by else []:
                    late = [p for p in close.aggregators[k]
                            if (k, p) in claims and stage.result(keys, r, p, k) not in listed]
                    for peer in late:
                        self._withheld(close, peer, f"claimed its {stage.noun} for part {k} of round {r} and did "
                                       "not reveal them in time", roster, out)
                    if late:
                        leave(k, f"{' and '.join(late)} did not reveal in time")
            if all(decided(k) for k in parts) or now >= by:
                return listed
            self.renew()
            self.clock.sleep(min(self.poll_s, max(0.0, (by if now >= reveal_by else reveal_by) - now)))

    def _seal(self, close: Close, stage: Stage, claimed: list[tuple[int, str]], listed: dict, roster) -> dict:
        """The ``claimed`` claims of ``stage``, read and sealed (one signed record) before the reveal."""
        run, r = self.run, close.round
        claims = {(k, p): c for k, p in claimed if (c := read_signed(
            run, stage.claim(run.keys, r, p, k), Claim, roster, f"{stage.reveal} claim of part {k} by {p}",
            listed, round=r, peer=p, part=k)) is not None}
        body = {"round": r, "claims": [c.model_dump() for c in claims.values()]}
        run.bucket.write_json(stage.sealed(run.keys, r),
                              run.record(f"sealed {stage.reveal} claims of round {r}", body, round=r))
        return claims

    def _sealed(self, close: Close, stage: Stage) -> dict[tuple[int, str], Claim] | None:
        """The claims of ``stage`` this round's scheduler sealed before revealing (a restart finds
        them), by part and peer; None before that (one GET)."""
        r = close.round
        found = self.run.read_record(stage.sealed(self.run.keys, r),
                                     f"sealed {stage.reveal} claims of round {r}", round=r)
        if found is None:
            return None
        claims = [Claim.model_validate(c) for c in found["claims"]]
        return {(c.part, c.peer): c for c in claims}

    def _revealed(self, close: Close, stage: Stage, k: int, listed: dict, roster, claims: dict, seen: dict,
                  left: dict, liars: dict) -> dict | None:
        """Part k's revealed results of ``stage`` by peer, each held to its sealed claim (``seen``
        keeps those read); None while one is not in, or with the part ``left`` (why: an aggregator
        that had not claimed, a result unusable, or other than its claim: a liar)."""
        run, r = self.run, close.round
        out = {}
        for peer in close.aggregators[k]:
            claim = claims.get((k, peer))
            if claim is None:
                left[k] = f"{peer} had not claimed part {k} when the answers were revealed"
                return None
            key = stage.result(run.keys, r, peer, k)
            if key not in listed:
                return None
            if (k, peer) not in seen:
                res = read_signed(run, key, stage.model, roster, f"{stage.noun} of part {k} by {peer}", listed,
                              len(close.accepted), round=r, peer=peer, part=k)
                if res is None:
                    left[k] = f"{peer}'s result unusable"
                    return None
                seen[(k, peer)] = res
                if claim.digest != digest(peer, getattr(res, stage.field)):
                    liars[peer] = f"revealed {stage.noun} for part {k} of round {r} other than it claimed"
                    left[k] = f"{peer} revealed other than it claimed"
                    return None
            out[peer] = seen[(k, peer)]
        return out

    def _try(self, close: Close, k: int, listed: dict, roster, claims: dict, out: Settlement) -> None:
        """Settle part k if both its aggregators' results are in and agree: copy, then mark."""
        run, r, keys = self.run, close.round, self.run.keys
        peers = close.aggregators[k]
        for peer in peers:  # a result is written after its objects: a listing with it has them
            if (k, peer) not in out.fingerprints and keys.result(r, peer, k) in listed:
                found = fingerprints(run, keys.answer(r, peer, k), listed)
                out.fingerprints[(k, peer)] = {path: tag for (path, _), tag in found.items()}
                if stray := sorted(path for path, chunk in found if chunk not in run.part_chunks(k)):
                    # only the keys of the part it was given are ever copied into a state
                    out.liars[peer] = f"its answer for part {k} of round {r} holds objects of other parts ({stray[0]})"
                    out.left[k] = f"{peer}'s answer holds objects of other parts"
        if k in out.left:
            return
        if (results := self._revealed(close, PARTS, k, listed, roster, claims, out.results, out.left,
                                      out.liars)) is None:
            return
        a = peers[0]
        if any(results[p].checksums != results[a].checksums or out.fingerprints[(k, p)] != out.fingerprints[(k, a)]
               for p in peers[1:]):
            out.left[k] = f"{' and '.join(peers)} disagree"
            return
        if set(results[a].checksums) != set(aggregation.next_formats(run)):
            out.left[k] = "an answer without every vector of a state, or with others"
            return
        if not self._audited(close, PARTS, k, roster, lambda chunks: audit.answer(
                run, close, k, chunks, results[a].checksums, keys.answer(r, a, k)), out):
            out.left[k] = "its audit found a lie"
            return
        copied = []
        try:
            for path, tag in sorted(out.fingerprints[(k, a)].items()):
                copied.append(keys.state_object(r + 1, path))
                run.bucket.copy(keys.answer_object(r, a, k, path), copied[-1], tag)
        except FileNotFoundError as exc:  # changed or deleted since it was listed: not the answer agreed on
            for key in copied:  # the organizer's answer may leave a chunk of zeros unstored there
                run.bucket.delete(key)
            out.left[k] = f"{a}'s answer changed while it was copied ({exc})"
            return
        run.bucket.write_json(keys.applied(r + 1, k), aggregation.applied_marker(k, results[a].checksums, peers))
        out.agreed[k] = list(peers)
        log.info("round %d: part %d agreed by %s", r, k, " and ".join(peers))

    def _screen(self, close: Close, roster, reveal: Callable[[str], None], out: Settlement, parts: list[int],
                start: float, by: float) -> tuple[float, list[int]]:
        """Check the shards CLOSE admitted unread (``SCREEN``) by ``by``: each part of every one
        by its two aggregators, the organizer checking the parts they do not agree on; record
        which shards the checks reject and every norm (``close.with_checks``: what every reader of
        the round takes). When the next exchange starts, and its parts."""
        run, r = self.run, close.round

        def own(parts: list[int]) -> dict[int, list[list[float]]]:
            with ThreadPoolExecutor(self.parallel) as pool:
                return dict(zip(parts, pool.map(lambda k: aggregation.part_checks(
                    run, k, close.accepted, aggregation.read_part(run, close.accepted, k)), parts)))

        def record(checks: dict[int, list[list[float]]]) -> dict:
            checks = self._rejudge(close, checks, out)
            verdicts: dict[str, float | str] = {}
            for i, e in enumerate(close.accepted):
                bad = [k for k in sorted(checks) if not min(checks[k][i]) >= 0]
                norm = math.sqrt(sum(x for k in sorted(checks) for x in checks[k][i])) if not bad else 0.0
                verdicts[e.key] = (f"its chunks of part {bad[0]} are not its manifest's, malformed or not finite "
                                   "(checked after CLOSE)") if bad else norm
            kept, rejected = admission.judge_contents(close.accepted, verdicts, run.config.max_grad_norm,
                                                run.config.norm_screen)
            for x in rejected:
                log.warning("round %d: rejected shard %s: %s", r, x.key, x.reason)
                if isinstance(norm := verdicts[x.key], float) and norm > run.config.max_grad_norm:
                    flags.out_of_bounds(run, r, x.key, x.reason)  # its own values: it cannot retry for free
            return {"rejected": [x.dump() for x in rejected], "norms": {e.key: e.norm for e in kept}}

        def valid(k: int) -> Callable[[list[list[float]]], bool]:
            n = len(run.part_chunks(k))  # per shard, each chunk's sum of squares, or -1 in each
            return lambda checks: len(checks) == len(close.accepted) and all(
                len(x) == n and (all(math.isfinite(v) and v >= 0 for v in x) or all(v == -1 for v in x))
                for x in checks)
        return self._recorded(close, SCREEN, parts, start, by, roster, reveal, out, out.screened, out.screens,
                              valid, own, record, lambda k, chunks, value: audit.screen(run, close, k, chunks, value))

    def _rejudge(self, close: Close, checks: dict[int, list[list[float]]],
                 out: Settlement) -> dict[int, list[list[float]]]:
        """A shard that the aggregators of a part agreed to reject there is checked again in
        that part by the organizer (one ranged read of that part of that shard) before the round
        counts without it: a pair, two names of one person perhaps, cannot decide alone what
        counts. Where the organizer finds it sound, its check replaces theirs and they are flagged."""
        run, r = self.run, close.round
        checks = {k: list(v) for k, v in checks.items()}
        for k, peers in sorted(out.screened.items()):
            refused = [i for i, _ in enumerate(close.accepted) if not min(checks[k][i]) >= 0]
            if not refused:
                continue
            shards = [close.accepted[i] for i in refused]  # part k of each, read once
            mine = aggregation.part_checks(run, k, shards, aggregation.read_part(run, shards, k))
            for i, e, value in zip(refused, shards, mine):
                if min(value) >= 0:
                    checks[k][i] = value
                    for peer in peers:
                        out.liars.setdefault(peer, f"its checks rejected shard {e.key} in part {k} of round {r}, "
                                                   "which the organizer found sound")
        return checks

    def _recorded(self, close: Close, stage: Stage, parts: list[int], start: float, by: float, roster,
                  reveal: Callable[[str], None], out: Settlement, agreed: dict, seen: dict,
                  valid: Callable[[int], Callable], own: Callable[[list[int]], dict], record: Callable[[dict], dict],
                  check: Callable[[int, list[int], object], str | None]) -> tuple[float, list[int]]:
        """An exchange before the answers' (``stage``) over ``parts``, from ``start`` to ``by``:
        what two aggregators agree on (``agreed``, each part's results ``valid(k)``), the
        organizer's ``own`` for every other part, and whoever revealed other than that flagged;
        then the scheduler's record of it (``record`` of every part's value, signed) and
        ``reveal(stage.recorded)``. Each agreement is audited first (``check(k, chunks, value)``,
        ``_audited``). When the next exchange starts, and its parts: those agreed on and audited
        (read back from the record after a restart)."""
        run, r = self.run, close.round
        key, what = stage.record(run.keys, r), f"{stage.record.__name__} of round {r}"
        found = run.read_record(key, what, round=r)
        if found is None:
            left: dict[int, str] = {}

            def settle(k: int, listed: dict, claims: dict) -> None:
                if self._agreed(close, stage, k, listed, roster, claims, seen, left, out.liars, valid(k)):
                    agreed[k] = list(close.aggregators[k])
            self._exchange(close, stage, parts, start, by, roster, reveal, settle, lambda k: k in agreed or k in left,
                           left.setdefault, out)
            for k, peers in sorted(agreed.items()):
                value = getattr(seen[(k, peers[0])], stage.field)
                if not self._audited(close, stage, k, roster, lambda chunks: check(k, chunks, value), out):
                    del agreed[k]
                    left[k] = "its audit found a lie"
            mine = [k for k in range(len(close.aggregators)) if k not in agreed]
            for k in mine:
                log.warning("round %d: the %s of part %d left to the organizer: %s", r, stage.noun, k,
                            left.get(k, "no agreement by the deadline"))
            values = {k: getattr(seen[(k, peers[0])], stage.field) for k, peers in agreed.items()} | own(mine)
            for (k, peer), res in sorted(seen.items()):
                if k in mine and getattr(res, stage.field) != values[k] and peer not in out.liars:
                    out.liars[peer] = f"its {stage.noun} for part {k} of round {r} differ from the organizer's"
            found = {"round": r, **record(values), "parts": sorted(agreed), "at": self.clock.time()}
            run.bucket.write_json(key, run.record(what, found, round=r))
        reveal(stage.recorded)
        return found["at"], found["parts"]

    def _agreed(self, close: Close, stage: Stage, k: int, listed: dict, roster, claims: dict, seen: dict,
                left: dict, liars: dict, valid: Callable[[object], bool]) -> bool:
        """Whether part k's results of ``stage`` (``_revealed``) are all in, the same, and
        ``valid``; else, once decided, why not in ``left``."""
        if (found := self._revealed(close, stage, k, listed, roster, claims, seen, left, liars)) is None:
            return False
        peers = close.aggregators[k]
        value = getattr(found[peers[0]], stage.field)
        if any(getattr(found[p], stage.field) != value for p in peers[1:]):
            left[k] = f"{' and '.join(peers)} disagree on its {stage.noun}"
            return False
        if not valid(value):
            left[k] = f"its {stage.noun} agreed on, but malformed"
            return False
        return True

    def _norms(self, close: Close, roster, reveal: Callable[[str], None], out: Settlement, parts: list[int],
               start: float, by: float) -> tuple[float, list[int]]:
        """LAMB: settle the partial sums (``SUMS``) of ``parts`` by ``by``, the organizer summing
        every other part (its reduction of the part); record the merged norms (what every part's
        step takes). When the steps' exchange starts, and its parts."""
        run, r, keys = self.run, close.round, self.run.keys

        def own(mine: list[int]) -> dict[int, list[dict]]:
            with ThreadPoolExecutor(self.parallel) as pool:
                list(pool.map(lambda k: aggregation.reduce_part(run, r, k), mine))
            markers = run.bucket.read_many([keys.reduced_marker(r, k) for k in mine])
            return {k: json.loads(markers[keys.reduced_marker(r, k)])["partials"] for k in mine}

        def valid(k: int) -> Callable[[list[dict]], bool]:
            fmt = run.dense_format  # per chunk, each tensor's sums there
            tensors = [{t.name for t, _, _ in run.flat.pieces(*fmt.bounds("values", range(c, c + 1)))}
                       for c in run.part_chunks(k)]
            return lambda sums: len(sums) == len(tensors) and all(set(s) == t for s, t in zip(sums, tensors)) and all(
                len(v) == 2 and all(math.isfinite(x) and x >= 0 for x in v) for s in sums for v in s.values())
        return self._recorded(close, SUMS, parts, start, by, roster, reveal, out, out.summed, out.sums, valid, own,
                              lambda sums: {"norms": optim.merge_partials([s for k in sorted(sums) for s in sums[k]])},
                              lambda k, chunks, value: audit.sums(run, close, k, chunks, value))

    def judge(self, close: Close, out: Settlement) -> None:
        """Once the organizer has computed the parts left: flag each aggregator whose revealed
        answer for one of them differs from the organizer's (its checksums, or its objects'
        fingerprints), and each found lying before (a result that is not its claim)."""
        run, r, keys = self.run, close.round, self.run.keys
        liars = dict(out.liars)
        checked = [(k, peer) for (k, peer) in out.results if k in out.left and peer not in liars]
        own = fingerprints(run, keys.state(r + 1), run.bucket.listing(keys.state(r + 1))) if checked else {}
        for k, peer in checked:
            marker = run.bucket.read_json(keys.applied(r + 1, k))
            mine = {path: tag for (path, chunk), tag in own.items() if chunk in run.part_chunks(k)}
            if out.results[(k, peer)].checksums != marker["vectors"]:
                liars[peer] = f"its answer for part {k} of round {r} differs from the organizer's"
            elif out.fingerprints[(k, peer)] != mine:
                liars[peer] = f"its objects for part {k} of round {r} are not the bytes of the organizer's answer"
        for peer, why in sorted(liars.items()):
            raise_flag(run, Flag(volunteer=volunteer_of(peer), peer=peer, round=r, verdict=WRONG_PART, reason=why,
                                 flagged_at=run.clock.time()))
