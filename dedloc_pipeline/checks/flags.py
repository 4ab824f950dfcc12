"""Flags: the verdict that shuts a volunteer out, its shards and offers refused from then on.

Two judges raise one: the validator, whose recomputation a shard does not match (or which finds
it a copy), and the scheduler, which catches an aggregator answering other than it claimed or
than the organizer's own answer (or than its audit), and a volunteer whose signed shard holds
values out of any bound (non-finite, or a norm above ``max_grad_norm``: no honest computation
gives them, and a rejection alone would let it try again every round for free). Both write it
through ``raise_flag`` and everyone reads it through ``read``, so a flag has one shape whoever
found it. The first flag of a volunteer stays.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..protocol.run import Run
from ..storage.layout import volunteer_of
from ..trust import identity

log = logging.getLogger(__name__)

WRONG_PART = "wrong part"  # the scheduler's verdict on an aggregator's answer
OUT_OF_BOUNDS = "out of bounds"  # the scheduler's verdict on a shard's values


class Flag(BaseModel):
    """A volunteer's flag record (``runs/RUN/flags/VOLUNTEER.json``, signed in a signed run)."""

    model_config = ConfigDict(extra="forbid")

    volunteer: str
    peer: str
    round: int
    verdict: Literal["mismatch", "copy", "wrong part", "out of bounds"]
    reason: str
    flagged_at: float
    key: str | None = None  # its volunteer's enrolled public key (signed runs): the flag binds the person
    shard: str | None = None  # the validator's: the shard it caught, and how far it was from its recomputation
    cosine: float | None = None
    norm_ratio: float | None = None
    run: str | None = None  # in a signed run: bound to its run (Run.record) and signed by the organizer
    signature: str | None = None

    @property
    def by(self) -> str:
        """Who raised it, as a rejection names them."""
        return {WRONG_PART: "scheduler, as an aggregator,", OUT_OF_BOUNDS: "scheduler"}.get(self.verdict, "validator")


def raise_flag(run: Run, flag: Flag) -> bool:
    """Write ``flag`` unless its volunteer has one already (create-once); True if it is new. In a
    signed run it names the volunteer's enrolled key, so the person stays out under any name."""
    if run.signed and flag.key is None:
        roster = identity.read_roster(run.bucket, run.name, run.config.organizer_key)
        if roster is not None and flag.volunteer in roster.volunteers:
            flag = flag.model_copy(update={"key": roster.volunteers[flag.volunteer]})
    body = flag.model_dump(mode="json", exclude_unset=True, exclude={"run", "signature"})
    if flag.key is not None:
        body["key"] = flag.key
    new = run.bucket.create_json(run.keys.flag(flag.volunteer),
                                 run.record(f"flag of {flag.volunteer}", body, volunteer=flag.volunteer))
    if new:
        log.warning("round %d: volunteer %s flagged by the %s: %s", flag.round, flag.volunteer,
                    flag.by.removesuffix(","), flag.reason)
    return new


def out_of_bounds(run: Run, r: int, shard: str, reason: str) -> bool:
    """Flag the volunteer of ``shard`` (a key of round r's) for values out of bounds (``reason``)."""
    peer = run.keys.shard_parts(shard)[1]
    return raise_flag(run, Flag(volunteer=volunteer_of(peer), peer=peer, round=r, verdict=OUT_OF_BOUNDS,
                                reason=f"its shard {shard}: {reason}", shard=shard, flagged_at=run.clock.time()))


def read(run: Run) -> dict[str, Flag]:
    """Volunteer name -> its flag: whose shards the scheduler refuses. In a signed run a flag
    counts only if the organizer signed it at its own place (else anyone could flag honest
    volunteers); one that does not is logged and ignored."""
    out = {}
    for key, raw in run.bucket.read_many(run.bucket.find(run.keys.flags_dir)).items():
        try:
            body = json.loads(raw)
            if run.signed:  # on the record as written: a signature is over it, not over its typed copy
                identity.check_record(run.config.organizer_key, body, f"flag {key}")
                if key != run.keys.flag(str(body.get("volunteer"))):
                    raise identity.IdentityError(f"flag of {body.get('volunteer')!r} stands at {key}: copied, refused")
                identity.check_place(body, f"flag {key}", run=run.name)
            flag = Flag.model_validate(body)
            out[flag.volunteer] = flag
        except (ValueError, identity.IdentityError) as exc:
            log.warning("flag %s ignored: %s", key, exc)
    return out


def flag_of(peer: str, flags: dict[str, Flag], roster: identity.Roster | None = None) -> Flag | None:
    """The flag that shuts ``peer`` out: its volunteer's, or one naming its volunteer's enrolled
    key (the same person under another name); None if it is not flagged."""
    name = volunteer_of(peer)
    if name in flags:
        return flags[name]
    key = roster.volunteers.get(name) if roster is not None else None
    return next((f for f in flags.values() if key is not None and f.key == key), None)


def refused_keys(flags: dict[str, Flag]) -> dict[str, str]:
    """The keys flags name, with why: what the roster does not enrol again under any name."""
    return {f.key: f"{f.volunteer} was flagged in round {f.round}" for f in flags.values() if f.key is not None}


def revoke(run: Run, organizer: identity.Ed25519PrivateKey, volunteer: str) -> bool:
    """Revoke a flagged volunteer's key in the signed roster; False if there is nothing to revoke
    (an unsigned run, a volunteer not enrolled or already revoked)."""
    if run.config.organizer_key is None:
        return False
    if identity.public(organizer) != run.config.organizer_key:
        raise identity.IdentityError(f"that key is not the organizer key of run {run.name!r}")
    roster = identity.read_roster(run.bucket, run.name, run.config.organizer_key)
    key = roster.volunteers.get(volunteer) if roster is not None else None
    if key is None or key in roster.revoked:
        return False
    identity.update_roster(run.bucket, run.name, organizer, revoke=[volunteer])
    log.warning("volunteer %s revoked", volunteer)
    return True
