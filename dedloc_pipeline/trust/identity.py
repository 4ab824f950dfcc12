"""Volunteer identity: Ed25519 keys, signed manifests, and the organizer's signed roster.

A run created with an organizer key admits only shards whose manifest is signed by an enrolled,
unrevoked volunteer. Enrolment lives in the bucket as ROSTER.json, signed by the organizer, so
volunteers can be added or revoked while the run goes on without touching the immutable run.json
(which holds only the organizer's public key). The signature covers every manifest field, round,
peer, part and chunk hashes included, so a shard cannot be replayed into another round or passed
off as another peer's, and an edited roster is refused.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field

from ..storage.bucket import Bucket
from ..storage.layout import RunLayout, name_problem, volunteer_of

NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"  # a volunteer; its peers are NAME or NAME.anything


class IdentityError(ValueError):
    """A key, signature or roster that cannot be used."""


def canonical(obj: dict) -> bytes:
    """The bytes that are signed: sorted keys, no spaces (json floats round-trip exactly)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def generate(path: str | Path) -> Ed25519PrivateKey:
    """A new private key in ``path`` (PKCS#8 PEM, readable by its owner only); never overwrites."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise IdentityError(f"{path} exists: a key is never overwritten") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def load(path: str | Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError as exc:
        if _is_public(str(path)):
            raise IdentityError(f"{str(path)[:8]}... is a public key (what the organizer enrolls): give the file "
                                "of your private key, made by `dedloc keygen --out FILE`") from exc
        raise IdentityError(f"no key at {path} (make one with `dedloc keygen`)") from exc
    except ValueError as exc:
        raise IdentityError(f"{path} is not a PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} is not an Ed25519 key")
    return key


def _is_public(text: str) -> bool:
    """Whether ``text`` reads as a public key as ``public`` writes it (32 bytes in base64)."""
    try:
        return len(base64.b64decode(text, validate=True)) == 32
    except ValueError:
        return False


def public(key: Ed25519PrivateKey) -> str:
    """The public half as base64 of its 32 raw bytes: what a volunteer sends the organizer."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def sign(key: Ed25519PrivateKey, obj: dict) -> str:
    return base64.b64encode(key.sign(canonical(obj))).decode()


def verify(public_key: str, obj: dict, signature: str | None) -> bool:
    if not signature:
        return False
    try:
        pub = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key, validate=True))
        pub.verify(base64.b64decode(signature, validate=True), canonical(obj))
        return True
    except (InvalidSignature, ValueError):
        return False


def sign_record(key: Ed25519PrivateKey, record: dict) -> dict:
    """``record`` with the organizer's signature over every other field (CLOSE, COMMIT, LATEST,
    streams): what only the organizer's machines may write, provably so."""
    body = {k: v for k, v in record.items() if k != "signature"}
    return body | {"signature": sign(key, body)}


def check_record(public_key: str, record: dict, what: str) -> dict:
    """``record`` if the organizer signed it; IdentityError naming it if not (forged, edited,
    or written by someone else's credentials)."""
    body = {k: v for k, v in record.items() if k != "signature"}
    if not verify(public_key, body, record.get("signature") if isinstance(record.get("signature"), str) else None):
        raise IdentityError(f"{what} is not signed by the run's organizer: refused")
    return record


def check_place(record: dict, what: str, **place) -> dict:
    """``record`` if it names the run and place (round, state, volunteer) that ``place`` gives:
    a signature proves who wrote a record, not where, so a reader checks that a genuine one was
    not copied (a COMMIT of state s at s+1 would freeze the model; a CLOSE of round r-1 at r
    would apply its gradient twice; another run's flag would shut out a volunteer here)."""
    wrong = [f"{field} {record.get(field)!r}, not {want!r}" for field, want in place.items()
             if record.get(field) != want]
    if wrong:
        raise IdentityError(f"{what} is a signed record of {'; '.join(wrong)}: copied from another place, refused")
    return record


def check_public(public_key: str) -> str:
    """``public_key`` if it is one. What is not is never echoed: it may be a private key pasted
    by mistake, which a terminal's scrollback or a CI log would then keep."""
    if "PRIVATE" in public_key or "-----BEGIN" in public_key:
        raise IdentityError("that is a private key (not shown): keep it secret, and pass the public key "
                            "`dedloc keygen` printed")
    try:
        Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key, validate=True))
    except ValueError as exc:
        raise IdentityError(f"not an Ed25519 public key ({len(public_key)} characters, not shown): pass the "
                            "public key `dedloc keygen` printed") from exc
    return public_key


class Roster(BaseModel):
    """Who may contribute to a run: volunteer name -> public key, and the revoked keys."""

    model_config = ConfigDict(extra="forbid")

    run: str
    version: int = Field(0, ge=0, description="grows with each change: an older roster is a replay")
    volunteers: dict[str, str] = {}
    revoked: list[str] = []
    aggregators: list[str] = Field([], description="the volunteers who may aggregate parts (checks/exchange.py)")
    signed_at: float = 0.0
    signature: str | None = None

    def payload(self) -> dict:
        """What the organizer signs (without aggregators where there are none, as rosters were
        signed before volunteers could aggregate)."""
        unsigned = {"signature"} if self.aggregators else {"signature", "aggregators"}
        return self.model_dump(mode="json", exclude=unsigned)

    def key_of(self, peer: str) -> str:
        """The public key that must sign ``peer``'s shards; IdentityError if it has none."""
        name = volunteer_of(peer)
        key = self.volunteers.get(name)
        if key is None:
            raise IdentityError(f"peer {peer!r} is not enrolled")
        if key in self.revoked:
            raise IdentityError(f"volunteer {name!r} is revoked")
        return key

    def person(self, peer: str) -> str:
        """Who ``peer`` is: its volunteer's public key (its name, where it has none), so that two
        names of one key count as one volunteer wherever that matters (pairs, flags)."""
        return self.volunteers.get(volunteer_of(peer), volunteer_of(peer))

    def may_aggregate(self, peer: str) -> bool:
        """Whether ``peer``'s volunteer is enrolled, not revoked, and named an aggregator."""
        try:
            self.key_of(peer)
        except IdentityError:
            return False
        return volunteer_of(peer) in self.aggregators


def read_roster(bucket: Bucket, run: str, organizer_key: str) -> Roster | None:
    """The run's roster if its organizer signed it; None if there is none yet."""
    raw = bucket.read_bytes(RunLayout(run).roster)
    if raw is None:
        return None
    try:
        roster = Roster.model_validate_json(raw)
    except ValueError as exc:
        raise IdentityError(f"run {run!r}: ROSTER.json is malformed") from exc
    if roster.run != run or not verify(organizer_key, roster.payload(), roster.signature):
        raise IdentityError(f"run {run!r}: ROSTER.json is not signed by the run's organizer")
    return roster


def update_roster(bucket: Bucket, run: str, organizer: Ed25519PrivateKey, enroll: dict[str, str] | None = None,
                  revoke: list[str] = (), replace: bool = False, aggregate: list[str] = (),
                  refused: dict[str, str] | None = None) -> Roster:
    """Enrol volunteers (name -> public key), name those who may aggregate (enrolled ones), and
    revoke others by name; sign; write. A name enrolled with another key keeps it unless
    ``replace``: a typo must not hand someone's name, and its stream, to another key. One key is
    one volunteer: a key enrolled under another name, revoked, or ``refused`` (key -> why: a
    flag names it) is not enrolled again, so one person cannot hold two names, nor come back
    under a new one."""
    org = public(organizer)
    roster = read_roster(bucket, run, org) or Roster(run=run)
    volunteers, revoked = dict(roster.volunteers), list(roster.revoked)
    for name, key in (enroll or {}).items():
        if not re.fullmatch(NAME, name):
            raise IdentityError(f"volunteer name {name!r} must match {NAME}")
        if problem := name_problem(name, "volunteer name"):
            raise IdentityError(problem)
        if check_public(key) in revoked:
            raise IdentityError(f"that key was revoked: {name!r} needs a new one (`dedloc keygen`)")
        if key in (refused or {}):
            raise IdentityError(f"that key is refused ({refused[key]}): it is not enrolled again under any name")
        if (other := next((n for n, k in volunteers.items() if k == key and n != name), None)) is not None:
            raise IdentityError(f"that key is enrolled as {other!r}: one key is one volunteer (a volunteer runs "
                                f"several machines as peers {other}.NAME)")
        if volunteers.get(name, key) != key and not replace:
            raise IdentityError(f"volunteer {name!r} is enrolled with another key: pass --replace to give the "
                                "name to this key (the old key's shards are refused from then on)")
        volunteers[name] = key
    for name in revoke:
        if name not in volunteers:
            raise IdentityError(f"no volunteer {name!r} in the roster")
        revoked.append(volunteers[name])
    for name in aggregate:
        if name not in volunteers:
            raise IdentityError(f"no volunteer {name!r} in the roster: enrol it first")
    new = Roster(run=run, version=roster.version + 1, volunteers=volunteers, revoked=sorted(set(revoked)),
                 aggregators=sorted(set(roster.aggregators) | set(aggregate)), signed_at=time.time())
    new.signature = sign(organizer, new.payload())
    keys = RunLayout(run)
    if not bucket.create(keys.roster_version(new.version), new.model_dump_json(indent=1).encode()):
        raise IdentityError(f"roster version {new.version} exists already: another change raced this one; run it again")
    bucket.write_bytes(keys.roster, new.model_dump_json(indent=1).encode())
    return new


def newest_roster(bucket: Bucket, run: str, organizer_key: str) -> Roster | None:
    """The newest roster version the organizer signed, from the create-once history (names that
    are no version, and versions whose signature fails, are passed over)."""
    keys = RunLayout(run)
    versions = sorted((v for v in map(keys.number_of, bucket.list(keys.rosters)) if v is not None), reverse=True)
    for v in versions:
        try:
            roster = Roster.model_validate_json(bucket.read_bytes(keys.roster_version(v)) or b"")
        except ValueError:
            continue
        if roster.run == run and roster.version == v and verify(organizer_key, roster.payload(), roster.signature):
            return roster
    return None
