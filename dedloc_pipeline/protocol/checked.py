"""Checked aggregation: volunteers aggregate the model's parts, two to a part, and a part is
committed only when their answers agree bit for bit (docs/aggregators.md).

The reduction and the optimizer step are reproducible to the bit on any machine
(``aggregator.mean_gradient``, ``aggregator.next_part``), so two honest aggregators give the
same bytes, and one that lies is found by the other. A round, once closed:

1. **offer**: while round r is open, a volunteer the roster lets aggregate writes
   ``volunteers/PEER/R/offer.json``, signed.
2. **assign**: CLOSE r names two offering aggregators per part, of two volunteers, never a
   flagged one, ranked by a hash of the CLOSE itself (``assign``): nobody knows its parts, or
   its partner, before the round is closed.
3. **claim**: each reduces and steps its parts from the frozen shards and state r, and writes
   only a claim per part: the hash of its peer id and its answer's checksums (``digest``). Its
   answer stays on its machine, so a partner has nothing to copy.
4. **reveal**: once every assigned aggregator has claimed (or half the time is out), the
   scheduler's round view says so (``reveal``); each writes its answer's objects under
   ``volunteers/PEER/R/parts/PART/`` (the paths of state r+1), then its result (the checksums).
5. **settle**: the scheduler checks each result against its claim and the two against each
   other, and the objects' fingerprints (S3's ETag: the store's own MD5 of the bytes, from the
   listing it makes anyway), then copies one answer's objects into state r+1 server-side, each
   only while it still has that fingerprint, and writes the part's applied marker naming both.
   What is not settled by the deadline (``close.aggregate_s`` after CLOSE: a disagreement, a
   missing answer, a vanished aggregator) the organizer computes itself, as without volunteer
   aggregators, and flags an aggregator whose revealed answer differs from its own.

So what aggregators write reaches a state only through that agreement, and a round never
waits on them past the deadline. LAMB's trust ratios need every part's sums before any step:
its parts stay the organizer's.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, ValidationError

from ..storage.layout import volunteer_of
from ..trust import identity
from . import aggregator
from .clock import Clock
from .close import Close
from .run import Run

log = logging.getLogger(__name__)
PER_PART = 2  # independent aggregators a part needs to agree


class _Record(BaseModel):
    """What an aggregator writes: signed with its volunteer's key, naming its run, round and peer."""

    model_config = ConfigDict(extra="forbid")

    run: str
    round: int
    peer: str
    signature: str | None = None


class Offer(_Record):
    """An aggregator's offer for its round."""

    at: float


class Claim(_Record):
    """An aggregator's commitment to its answer for a part: ``digest(peer, checksums)``."""

    part: int
    digest: str


class Result(_Record):
    """An aggregator's revealed answer for a part: every vector's chunk checksums."""

    part: int
    checksums: dict[str, dict[str, list[str]]]


def digest(peer: str, checksums: dict) -> str:
    """What a claim commits to: the answer's checksums, bound to who computed them, so a claim
    copied from a partner's is no claim of one's own."""
    return hashlib.sha256(identity.canonical({"peer": peer, "checksums": checksums})).hexdigest()


def seed(close: Close) -> str:
    """What ranks the aggregators of a round: a hash of its CLOSE (which shards, their checksums,
    when it closed), which nobody can know before the round is closed."""
    return hashlib.sha256(identity.canonical(close.dump())).hexdigest()


def assign(seed_: str, parts: int, offers: list[str]) -> list[list[str]] | None:
    """``PER_PART`` aggregators for each part, of as many volunteers, ranked per part by a hash
    of the seed, the part and the peer; None with fewer volunteers offering than that."""
    if len({volunteer_of(p) for p in offers}) < PER_PART:
        return None
    out = []
    for k in range(parts):
        chosen: list[str] = []
        for peer in sorted(offers, key=lambda p: hashlib.sha256(f"{seed_}/{k}/{p}".encode()).hexdigest()):
            if volunteer_of(peer) not in {volunteer_of(c) for c in chosen}:
                chosen.append(peer)
            if len(chosen) == PER_PART:
                break
        out.append(chosen)
    return out


def eligible(run: Run) -> str | None:
    """Why this run's parts cannot go to volunteer aggregators (None: they can)."""
    if not run.signed:
        return "an unsigned run has no roster to say who may aggregate"
    if run.config.aggregator_optimizer.name == "lamb":
        return "LAMB's trust ratios need every part's sums before any step"
    return None


def bound(run: Run, model: type[BaseModel]) -> int:
    """The most bytes an aggregator's record of ``model`` may take: a result lists a checksum
    (64 bytes, generously) per chunk of each array of a state's vectors over a part; the others
    are a few fields. A larger one is refused unread: no record slows the scheduler."""
    if model is not Result:
        return 4096
    arrays = sum(len(fmt.stored()) for fmt in aggregator.next_formats(run).values())
    return 4096 + 64 * arrays * max(len(run.part_chunks(k)) for k in range(run.n_parts))


def _signed(run: Run, key: str, model: type[BaseModel], roster, what: str, listed: dict, **place):
    """A volunteer's record at ``key``, signed with the key the roster has for its peer and naming
    its run and ``place``; None if absent, larger than its ``bound`` (in ``listed``, the listing
    it was found in: not read at all; or once read, if rewritten since: never more than the bound
    and a byte is downloaded), unreadable, forged or copied (logged)."""
    limit = bound(run, model)
    size = listed.get(key, (0, None))[0]
    if size > limit:
        log.warning("%s refused unread: %d bytes, more than %d", what, size, limit)
        return None
    raw = run.bucket.read_if_changed(key, None, limit=limit + 1).data  # a volunteer may rewrite its keys
    if raw is None:
        return None
    if len(raw) > limit:
        log.warning("%s refused: more than %d bytes, rewritten since it was listed", what, limit)
        return None
    try:
        record = model.model_validate_json(raw)
        body = record.model_dump(mode="json")
        identity.check_record(roster.key_of(record.peer), body, what)
        identity.check_place(body, what, run=run.name, **place)
        return record
    except (ValidationError, ValueError, identity.IdentityError) as exc:
        log.warning("%s refused: %s", what, exc)
        return None


def _fingerprints(run: Run, base: str, listed: dict) -> dict[tuple[str, int], str]:
    """The fingerprints (``Bucket.fingerprints``) of the chunk objects of a state's vectors that
    ``listed`` holds below ``base`` (a state, or an answer), by their path there and chunk."""
    found = {key: at for key in listed if (at := run.keys.state_path(base, key))}
    return {found[key]: tag for key, tag in run.bucket.fingerprints({k: listed[k] for k in found}).items()}


@dataclass
class Settlement:
    """How round r's parts were settled: by the two aggregators (``agreed``), or left to the
    organizer (``left``, why), with every result revealed (for the flags after)."""

    agreed: dict[int, list[str]] = field(default_factory=dict)
    left: dict[int, str] = field(default_factory=dict)
    results: dict[tuple[int, str], Result] = field(default_factory=dict)
    fingerprints: dict[tuple[int, str], dict[str, str]] = field(default_factory=dict)
    liars: dict[str, str] = field(default_factory=dict)  # peer -> why, found without the organizer's answer


class Referee:
    """The scheduler's side: which offers count, and how a closed round's parts settle."""

    def __init__(self, run: Run, clock: Clock, poll_s: float = 2.0):
        self.run, self.clock, self.poll_s = run, clock, poll_s

    def offers(self, r: int, listed: dict, roster, flagged: dict) -> list[str]:
        """The peers whose offers for round r are in ``listed``, signed, of volunteers the
        roster lets aggregate and no flag shuts out (one GET an offer)."""
        out = []
        for key in self.run.keys.of_round(listed, r, "offer"):
            peer = self.run.keys.written(key).peer
            if roster is None or not roster.may_aggregate(peer) or volunteer_of(peer) in flagged:
                continue
            if _signed(self.run, key, Offer, roster, f"offer {key}", listed, round=r, peer=peer) is not None:
                out.append(peer)
        return out

    def settle(self, close: Close, roster, reveal) -> Settlement:
        """Wait for round ``close.round``'s aggregators, calling ``reveal()`` once every assigned one
        has claimed or half the time is out, and settle each part whose two answers agree, until
        every part is decided or ``close.aggregate_by`` (the run's clock) passes."""
        run, r, keys = self.run, close.round, self.run.keys
        out, claims = Settlement(), self._sealed(close)
        revealed = claims is not None
        if revealed:  # sealed before a restart: the answers may be revealed already, and are again
            reveal()
        for key in run.bucket.listing(keys.applied_dir(r + 1)):  # parts settled before a restart
            if (k := keys.applied_part(r + 1, key)) is not None and k < len(close.aggregators):
                out.agreed[k] = close.aggregators[k]
        half = close.closed_at + (close.aggregate_by - close.closed_at) / 2
        while True:
            listed, _ = run.written()
            claimed = {(int(w.part), w.peer) for k in keys.of_round(listed, r, "claim") if (w := keys.written(k))}
            wanted = {(k, p) for k, peers in enumerate(close.aggregators) for p in peers}
            now = self.clock.time()
            if not revealed and (wanted <= claimed or now >= half):
                # read and sealed before anyone may reveal: a claim written after could copy an answer
                claims = {(k, p): c for k, p in sorted(wanted & claimed) if (c := _signed(
                    run, keys.claim(r, p, k), Claim, roster, f"claim of part {k} by {p}", listed, round=r, peer=p,
                    part=k)) is not None}
                run.bucket.write_json(keys.sealed_claims(r), run.record(
                    f"sealed claims of round {r}", {"round": r, "claims": [c.model_dump() for c in claims.values()]},
                    round=r))
                reveal()
                revealed = True
            if revealed:
                for k, peers in enumerate(close.aggregators):
                    if k not in out.agreed and k not in out.left:
                        self._try(close, k, peers, listed, roster, claims, out)
            if len(out.agreed) + len(out.left) == len(close.aggregators) or now >= close.aggregate_by:
                break
            self.clock.sleep(min(self.poll_s, max(0.0, close.aggregate_by - now)))
        for k in range(len(close.aggregators)):
            if k not in out.agreed:
                out.left.setdefault(k, "no agreement by the deadline")
                log.warning("round %d: part %d left to the organizer: %s", r, k, out.left[k])
        return out

    def _sealed(self, close: Close) -> dict[tuple[int, str], Claim] | None:
        """The claims this round's scheduler sealed before revealing (a restart finds them), by
        part and peer; None before that (one GET)."""
        found = self.run.read_record(self.run.keys.sealed_claims(close.round), f"sealed claims of round {close.round}",
                                     round=close.round)
        if found is None:
            return None
        claims = [Claim.model_validate(c) for c in found["claims"]]
        return {(c.part, c.peer): c for c in claims}

    def _try(self, close: Close, k: int, peers: list[str], listed: dict, roster, claims: dict,
             out: Settlement) -> None:
        """Settle part k if both its aggregators' results are in and agree: copy, then mark."""
        run, r, keys = self.run, close.round, self.run.keys
        results = {}
        for peer in peers:
            claim = claims.get((k, peer))
            if claim is None:
                out.left[k] = f"{peer} had not claimed part {k} when the answers were revealed"
                return
            if keys.result(r, peer, k) not in listed:
                return
            if (k, peer) not in out.results:
                res = _signed(run, keys.result(r, peer, k), Result, roster, f"result of part {k} by {peer}",
                              listed, round=r, peer=peer, part=k)
                if res is None:
                    out.left[k] = f"{peer}'s result unusable"
                    return
                if claim.digest != digest(peer, res.checksums):
                    out.liars[peer] = f"revealed for part {k} of round {r} an answer other than it claimed"
                    out.results[(k, peer)] = res
                    out.left[k] = f"{peer} revealed other than it claimed"
                    return
                out.results[(k, peer)] = res
                found = _fingerprints(run, keys.answer(r, peer, k), listed)
                out.fingerprints[(k, peer)] = {path: tag for (path, _), tag in found.items()}
            results[peer] = out.results[(k, peer)]
        a = peers[0]
        if any(results[p].checksums != results[a].checksums or out.fingerprints[(k, p)] != out.fingerprints[(k, a)]
               for p in peers[1:]):
            out.left[k] = f"{' and '.join(peers)} disagree"
            return
        if set(results[a].checksums) != set(aggregator.next_formats(run)):
            out.left[k] = "an answer without every vector of a state, or with others"
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
        run.bucket.write_json(keys.applied(r + 1, k), aggregator.applied_marker(k, results[a].checksums, peers))
        out.agreed[k] = list(peers)
        log.info("round %d: part %d agreed by %s", r, k, " and ".join(peers))

    def judge(self, close: Close, out: Settlement) -> None:
        """Once the organizer has computed the parts left: flag each aggregator whose revealed
        answer for one of them differs from the organizer's (its checksums, or its objects'
        fingerprints), and each found lying before (a result that is not its claim)."""
        run, r, keys = self.run, close.round, self.run.keys
        liars = dict(out.liars)
        checked = [(k, peer) for (k, peer) in out.results if k in out.left and peer not in liars]
        own = _fingerprints(run, keys.state(r + 1), run.bucket.listing(keys.state(r + 1))) if checked else {}
        for k, peer in checked:
            marker = run.bucket.read_json(keys.applied(r + 1, k))
            mine = {path: tag for (path, chunk), tag in own.items() if chunk in run.part_chunks(k)}
            if out.results[(k, peer)].checksums != marker["vectors"]:
                liars[peer] = f"its answer for part {k} of round {r} differs from the organizer's"
            elif out.fingerprints[(k, peer)] != mine:
                liars[peer] = f"its objects for part {k} of round {r} are not the bytes of the organizer's answer"
        for peer, why in sorted(liars.items()):
            flag(run, peer, r, why)


def flag(run: Run, peer: str, r: int, reason: str) -> None:
    """Shut a volunteer out, as the validator's flags do (``verify.flagged``): its offers and
    its shards are refused from then on. The first flag of a volunteer stays."""
    volunteer = volunteer_of(peer)
    body = {"volunteer": volunteer, "peer": peer, "round": r, "verdict": "wrong part", "reason": reason,
            "flagged_at": run.clock.time()}
    if run.bucket.create_json(run.keys.flag(volunteer), run.record(f"flag of {volunteer}", body, volunteer=volunteer)):
        log.warning("round %d: aggregator %s flagged: %s", r, peer, reason)
