"""Every check of a volunteer's work, listed once, in the order it runs.

A check has a name, the moment it runs at, what it catches and the setting that tunes it. The
scheduler runs the first two moments from here: each shard by itself as its manifest is read
(``validate``: a ``validation.Claim`` in, ``Rejected`` out), then the round's shards among each
other as CLOSE is written (``admit``: entries in, kept and rejected out). The checks after CLOSE
run in the aggregators' exchanges (the referee's); the validator runs those after COMMIT in this
list's order (``AFTER_COMMIT``). docs/verification.md's table of checks is this
list (``markdown``), and tests/test_checks.py runs an attack and its control through each one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ..protocol.close import Rejection
from ..protocol.config import RunConfig
from ..protocol.run import Run
from ..protocol.shard import DataRef, Entry, Rejected
from ..trust import identity
from . import admission, validation
from .flags import Flag


class Moment(str, Enum):
    VALIDATION = "validation"  # one shard by itself, as the scheduler reads its manifest
    CLOSE = "close"  # a shard among the round's others, as CLOSE is written
    AFTER_CLOSE = "after close"  # what CLOSE admitted unread, and the volunteer aggregators' answers
    AFTER_COMMIT = "after commit"  # the validator's recomputation of a random share of the shards


@dataclass(frozen=True)
class Round:
    """What the close's checks judge a round's shards by."""

    config: RunConfig
    flags: dict[str, Flag]
    roster: identity.Roster | None = None  # who is whom: names of a flagged key are flagged too


@dataclass(frozen=True)
class Check:
    """One judgement. ``judge``: for validation, a function of one shard's ``Claim`` that raises
    ``Rejected``; at close, ``(entries, Round) -> (kept, rejected)``; after, where it runs."""

    name: str
    moment: Moment
    catches: str
    setting: str | None = None
    judge: Callable | None = None
    where: str = ""


CHECKS: tuple[Check, ...] = (
    Check("manifest", Moment.VALIDATION, "a malformed manifest, or one naming another run, round, peer, part, "
          "codec or chunking, or missing chunks' checksums", judge=validation.manifest),
    Check("signature", Moment.VALIDATION, "a shard not signed by its volunteer's enrolled key, or of a revoked "
          "or unknown volunteer (signed runs)", "organizer_key", judge=validation.signature),
    Check("own stream", Moment.VALIDATION, "samples claimed from another peer's data stream",
          judge=validation.own_stream),
    Check("state", Moment.VALIDATION, "a shard computed on another state than its round's, or made ahead",
          judge=validation.state),
    Check("claims", Moment.VALIDATION, "an impossible loss or sample count, inner steps that do not add up, "
          "more samples than a shard can hold (4 target batches)", judge=validation.claims),
    Check("stream", Moment.VALIDATION, "samples that are not one run of its stream from where it was counted, "
          "or far past it", "close.max_parts", judge=validation.stream),
    Check("objects", Moment.VALIDATION, "missing chunk objects, or more bytes than its format takes",
          judge=validation.objects),
    Check("contents", Moment.VALIDATION, "chunks other than its checksums name, undecodable or non-finite "
          "values, a norm above the bound (left for after CLOSE with volunteer aggregators)", "max_grad_norm",
          judge=validation.contents),
    Check("loss screen", Moment.VALIDATION, "diloco: a pseudo-gradient that does not descend the loss of the "
          "samples it claims", "close.min_descent", judge=validation.inspected),
    Check("parts", Moment.CLOSE, "more parts of one volunteer than close.max_parts, or two over the same samples",
          "close.max_parts", judge=lambda e, rd: admission.bound_parts(e, rd.config.close.max_parts),
          where="admission.bound_parts"),
    Check("norm screen", Moment.CLOSE, "a shard far above the round's median volunteer's norm (a scaled "
          "gradient)", "norm_screen", judge=lambda e, rd: admission.norm_screen(e, rd.config.norm_screen),
          where="admission.norm_screen"),
    Check("direction screen", Moment.CLOSE, "diloco: a volunteer whose shards point away from the median "
          "volunteer's", "close.min_agreement", where="admission.direction_screen",
          judge=lambda e, rd: admission.direction_screen(e, rd.config.close.min_agreement)),
    Check("flags", Moment.CLOSE, "shards of a volunteer the validator or the scheduler flagged, under any "
          "name of its key",
          judge=lambda e, rd: admission.unflagged(e, rd.flags, rd.roster), where="admission.unflagged"),
    Check("checks after close", Moment.AFTER_CLOSE, "what the contents check catches, and the norm screen, for "
          "shards CLOSE admitted unread: each part checked by two aggregators, the organizer where they disagree",
          "max_grad_norm", where="admission.judge_contents (organizer/referee.py, organizer/judge.py)"),
    Check("answers", Moment.AFTER_CLOSE, "an aggregator whose checks, partial sums or answer are not what it "
          "claimed, or not the organizer's own: flagged", where="organizer/referee.py"),
    Check("audit", Moment.AFTER_CLOSE, "two aggregators (one person's names perhaps) agreeing on a lie: chunks of "
          "each part they agree on, drawn by the organizer's secret, recomputed from the frozen shards and the "
          "answer's objects there read: both flagged", "close.audit", where="checks/audit.py (organizer/referee.py)"),
    Check("recomputation", Moment.AFTER_COMMIT, "a shard whose gradient is not what its samples give on its "
          "state: flagged", "dedloc verify --fraction", where="verify.Verifier"),
    Check("copy screen", Moment.AFTER_COMMIT, "a shard copied from another volunteer's, disguised or not: "
          "flagged", "dedloc verify", where="recompute.similarities"),
    Check("reference pair", Moment.AFTER_COMMIT, "sparse: a shard within its loose tolerance but far short of "
          "another volunteer's replay in its round: flagged", "dedloc verify", where="verify.Verifier"),
)
VALIDATION = tuple(c for c in CHECKS if c.moment is Moment.VALIDATION)
AT_CLOSE = tuple(c for c in CHECKS if c.moment is Moment.CLOSE)
AFTER_COMMIT = tuple(c for c in CHECKS if c.moment is Moment.AFTER_COMMIT)  # the validator runs them in this order
SPENT_FROM = "own stream"  # once this check passed, the manifest is its peer's own: its samples are spent


def validate(run: Run, r: int, key: str, raw: bytes, roster: identity.Roster | None = None,
             stored: dict[str, int] | None = None, state_hash: str | None = None, stream_end: int | None = None,
             inspect: Callable | None = None, contents: bool = True) -> Entry:
    """Admit shard ``key`` of round r (its manifest ``raw``) through every validation check, in
    order, or raise ``Rejected`` naming the check. ``stored``: its objects' sizes by name under
    the shard, from a listing the caller made of many shards at once (listed here if not
    given); ``stream_end``: where its peer's stream was counted to as of state r (read here if
    not given); ``inspect(entry, arrays)``: what the caller measures of the shard's values (the
    local-steps mode's screens) on the arrays read here; ``contents`` False: no chunk is read,
    the entry's ``norm`` is None, and its contents are checked after CLOSE."""
    claim = validation.Claim(run, r, key, raw, roster, stored, state_hash, stream_end, inspect, contents)
    spent = False
    for check in VALIDATION:
        try:
            check.judge(claim)
        except Rejected as exc:  # of its kind: an OutOfBounds flags its volunteer
            raise type(exc)(str(exc), data=claim.manifest.data if spent else None, check=check.name) from exc
        spent = spent or check.name == SPENT_FROM
    return claim.entry


def spent(run: Run, r: int, key: str, raw: bytes, roster: identity.Roster | None = None) -> DataRef | None:
    """The samples shard ``key`` of round r (its manifest ``raw``) names, once the checks up to
    ``SPENT_FROM`` find the manifest its peer's own; None where one refuses it. What a shard that
    is never counted (it missed its round) spends of its stream."""
    claim = validation.Claim(run, r, key, raw, roster)
    for check in VALIDATION:
        try:
            check.judge(claim)
        except Rejected:
            return None
        if check.name == SPENT_FROM:
            return claim.manifest.data
    return None


def admit(entries: list[Entry], round_: Round,
          checks: tuple[Check, ...] = AT_CLOSE) -> tuple[list[Entry], list[Rejection]]:
    """The close's checks over a round's validated shards, in order: (kept, rejected). Weighing
    what is kept (``admission.weigh``) follows."""
    rejected: list[Rejection] = []
    for check in checks:
        entries, out = check.judge(entries, round_)
        rejected += out
    return entries, rejected


def markdown() -> str:
    """The table of checks in docs/verification.md (tests/test_docs.py keeps it equal)."""
    rows = ["| check | moment | catches | tuned by | judged in |", "| --- | --- | --- | --- | --- |"]
    for c in CHECKS:
        where = c.where or f"{c.judge.__module__.rpartition('.')[2]}.{c.judge.__name__}"
        rows.append(f"| {c.name} | {c.moment.value} | {c.catches} | {c.setting or ''} | `{where}` |")
    return "\n".join(rows) + "\n"
