"""Checked aggregation: volunteers aggregate the model's parts, two to a part, and a part is
committed only when their answers agree bit for bit (docs/aggregators.md).

The reduction and the optimizer step are reproducible to the bit on any machine
(``aggregation.mean_gradient``, ``aggregation.next_part``), so two honest aggregators give the
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
waits on them past the deadline. Claim, reveal and settle make one exchange (``Stage``); a
round may have two before the answers', each in its share of the time, each settled the same
way and recorded by the scheduler, signed, for what follows: the checks of the shards that
CLOSE admitted unread (each part of every shard: ``aggregation.part_checks``; recorded in
``rounds/R/screened.json``, which amends CLOSE for every reader), and with LAMB, whose trust
ratios need every tensor's sums before any step, each part's partial sums (their merged norms
in ``rounds/R/norms.json``). The organizer computes what an exchange leaves, and that part
stays its own. This module holds the records, the assignment and the bounds; the scheduler's
side is ``referee.py``, the volunteer's ``volunteer/aggregator.py``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

from ..compute import aggregation
from ..protocol.close import Close
from ..protocol.run import Run
from ..storage.layout import RunLayout, volunteer_of
from ..trust import identity

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


class Screen(_Record):
    """An aggregator's revealed check of a part of every shard of its round, in CLOSE's order:
    each one's sum of squares in each chunk of the part, or -1 in each (``aggregation.part_checks``)."""

    part: int
    checks: list[list[float]]


class Sums(_Record):
    """LAMB: an aggregator's revealed partial sums for a part, for each of its chunks per tensor
    [sum p^2, sum u^2] (``aggregation.part_sums``)."""

    part: int
    sums: list[dict[str, list[float]]]


@dataclass(frozen=True)
class Stage:
    """One commit/reveal exchange of a closed round, as both sides run it: the layout functions
    of its claims', its results' and its sealed claims' keys (a claim's and a result's kind in
    ``RunLayout.written`` is its function's name), its results' model and the field a claim's
    digest is of, what the round view says once its claims are sealed (``reveal``), and for an
    exchange before the answers', the layout function of the scheduler's record of it and what
    the view says once that is written (``recorded``); ``noun``: what a log line calls its
    results."""

    reveal: str
    claim: Callable[[RunLayout, int, str, int], str]
    result: Callable[[RunLayout, int, str, int], str]
    sealed: Callable[[RunLayout, int], str]
    model: type[_Record]
    field: str
    record: Callable[[RunLayout, int], str] | None = None
    recorded: str = ""
    noun: str = "answer"

    @property
    def claim_kind(self) -> str:
        """What ``RunLayout.written`` calls this stage's claims."""
        return self.claim.__name__


SCREEN = Stage("screen", RunLayout.screen_claim, RunLayout.screen, RunLayout.sealed_screens, Screen, "checks",
               record=RunLayout.screened, recorded="screened", noun="checks of the shards")
SUMS = Stage("sums", RunLayout.sum_claim, RunLayout.sums, RunLayout.sealed_sums, Sums, "sums",
             record=RunLayout.norms, recorded="norms", noun="partial sums")
PARTS = Stage("parts", RunLayout.claim, RunLayout.result, RunLayout.sealed_claims, Result, "checksums")
# what the round view says of a closed round's exchanges, in the order it says it
REVEALS = ("screen", "screened", "sums", "norms", "parts")


def stages(close: Close, run: Run) -> list[Stage]:
    """A closed round's exchanges, in order: the checks of the shards CLOSE admitted unread,
    LAMB's partial sums, the answers."""
    unchecked = any(e.norm is None for e in close.accepted)
    lamb = run.config.aggregator_optimizer.name == "lamb"
    return [SCREEN] * unchecked + [SUMS] * lamb + [PARTS]


def said(reveal: str | None, mark: str) -> bool:
    """Whether a view that says ``reveal`` has said ``mark`` already (or says it now)."""
    return reveal in REVEALS and REVEALS.index(reveal) >= REVEALS.index(mark)


def digest(peer: str, answer: dict) -> str:
    """What a claim commits to: the answer's checksums (or partial sums), bound to who computed
    them, so a claim copied from a partner's is no claim of one's own."""
    return hashlib.sha256(identity.canonical({"peer": peer, "checksums": answer})).hexdigest()


def seed(close: Close) -> str:
    """What ranks the aggregators of a round: a hash of its CLOSE (which shards, their checksums,
    when it closed), which nobody can know before the round is closed."""
    return hashlib.sha256(identity.canonical(close.dump())).hexdigest()


def assign(seed_: str, parts: int, offers: list[str],
           person: Callable[[str], str] = volunteer_of) -> list[list[str]] | None:
    """``PER_PART`` aggregators for each part, of as many people (``person``: who a peer is, the
    roster's key of its volunteer: two names of one key are one person), ranked per part by a
    hash of the seed, the part and the peer; None with fewer people offering than that."""
    if len({person(p) for p in offers}) < PER_PART:
        return None
    out = []
    for k in range(parts):
        chosen: list[str] = []
        for peer in sorted(offers, key=lambda p: hashlib.sha256(f"{seed_}/{k}/{p}".encode()).hexdigest()):
            if person(peer) not in {person(c) for c in chosen}:
                chosen.append(peer)
            if len(chosen) == PER_PART:
                break
        out.append(chosen)
    return out


def eligible(run: Run) -> str | None:
    """Why this run's parts cannot go to volunteer aggregators (None: they can)."""
    if not run.signed:
        return "an unsigned run has no roster to say who may aggregate"
    return None


def bound(run: Run, model: type[BaseModel], shards: int = 0) -> int:
    """The most bytes an aggregator's record of ``model`` may take: a result lists a checksum
    (64 bytes, generously) per chunk of each array of a state's vectors over a part, partial
    sums a name and two numbers per tensor and chunk (256 bytes), a check a number per shard of
    the round (``shards``) and chunk of the part (32 bytes); the others are a few fields. A larger
    one is refused unread: no record slows the scheduler."""
    chunks = run.config.chunks_per_part
    if model is Screen:
        return 4096 + 32 * shards * chunks
    if model is Sums:
        size = run.dense_format.chunk_size
        return 4096 + 256 * max(len(list(run.flat.pieces(lo, min(lo + size, run.flat.n)))) * chunks
                                for lo in range(0, run.flat.n, size))
    if model is not Result:
        return 4096
    arrays = sum(len(fmt.stored()) for fmt in aggregation.next_formats(run).values())
    return 4096 + 64 * arrays * max(len(run.part_chunks(k)) for k in range(run.n_parts))


def read_signed(run: Run, key: str, model: type[BaseModel], roster, what: str, listed: dict, shards: int = 0, **place):
    """A volunteer's record at ``key``, signed with the key the roster has for its peer and naming
    its run and ``place``; None if absent, larger than its ``bound`` (in ``listed``, the listing
    it was found in: not read at all; or once read, if rewritten since: never more than the bound
    and a byte is downloaded), unreadable, forged or copied (logged)."""
    limit = bound(run, model, shards)
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


def fingerprints(run: Run, base: str, listed: dict) -> dict[tuple[str, int], str]:
    """The fingerprints (``Bucket.fingerprints``) of the chunk objects of a state's vectors that
    ``listed`` holds below ``base`` (a state, or an answer), by their path there and chunk."""
    found = {key: at for key in listed if (at := run.keys.state_path(base, key))}
    return {found[key]: tag for key, tag in run.bucket.fingerprints({k: listed[k] for k in found}).items()}
