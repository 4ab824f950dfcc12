"""CLOSE: the record that ends a round, written once by the scheduler and read by everyone after.

It lists every shard the round judged: the admitted ones (``shard.Entry``, with their weights in
the mean) and the rejected ones with the reason (``Rejection``). Aggregators reduce exactly its
accepted shards, the COMMIT copies its ledger fields, the validator picks among them. Typed here
so that every reader agrees on its fields; it serializes to the same JSON as ever.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .run import Run, RunError
from .shard import DataRef, Entry


class Rejection(BaseModel):
    """A shard that does not count, and why; ``data``: the samples it named, once its manifest is
    known to be its peer's own (they still advance its stream: ``ledger.stream_ends``)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    reason: str
    data: DataRef | None = None

    def dump(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


class Close(BaseModel):
    model_config = ConfigDict(extra="forbid")

    round: int
    samples: int  # counted: each volunteer's claims capped (admission.weigh)
    target: int
    accepted: list[Entry]
    roster: int | None  # the roster version the shards were judged with (signed runs)
    rejected: list[Rejection]
    opened_at: float | None = None
    started_at: float | None = None  # the scheduler first saw work on it (a live heartbeat or a shard)
    closed_at: float
    reason: Literal["target", "timeout"]
    # volunteer aggregators (checks/exchange.py): the two assigned to each part, and until when (the
    # scheduler's clock) their answers may settle it before the organizer computes it
    aggregators: list[list[str]] | None = None
    aggregate_by: float | None = None
    # shards of the round before that missed its CLOSE (policy reject): never counted, their
    # samples spent (``Judge.missed``), so their streams move past them
    missed: list[Rejection] = []
    run: str | None = None  # the run it closes, in a signed run (Run.record binds it there)
    signature: str | None = None  # the organizer's, in a signed run (Run.record)

    def dump(self) -> dict:
        """The JSON written to the bucket (without a signature: ``Run.record`` adds it)."""
        return {"round": self.round, "samples": self.samples, "target": self.target,
                "accepted": [e.dump() for e in self.accepted], "roster": self.roster,
                "rejected": [e.dump() for e in self.rejected], "opened_at": self.opened_at,
                "started_at": self.started_at, "closed_at": self.closed_at, "reason": self.reason,
                **({"aggregators": self.aggregators, "aggregate_by": self.aggregate_by} if self.aggregators else {}),
                **({"missed": [e.dump() for e in self.missed]} if self.missed else {})}

    def listed(self) -> set[str]:
        """Every shard key this CLOSE judged, accepted or rejected."""
        return {e.key for e in self.accepted} | {e.key for e in self.rejected}

    @classmethod
    def read(cls, run: Run, r: int) -> Close | None:
        """Round r's CLOSE, its signature checked in a signed run (IdentityError if forged);
        None while the round is open."""
        found = run.read_record(run.keys.close(r), f"CLOSE of round {r}", round=r)
        return None if found is None else cls.model_validate(found)


class LedgerShard(BaseModel):
    """An accepted shard as the COMMIT copies it from its CLOSE entry: the ledger's fields, what
    status and a volunteer's ledger read of a committed round."""

    model_config = ConfigDict(extra="forbid")

    key: str
    peer: str
    samples: int
    loss: float
    manifest_sha: str
    late: bool = False
    weight: float | None = None

    @property
    def counted(self) -> float:
        """The samples it counts for: its claim capped (``weight``)."""
        return self.samples if self.weight is None else self.weight


def committed(commit: dict) -> tuple[list[LedgerShard], list[Rejection]]:
    """A COMMIT's shards, accepted and rejected, typed."""
    return ([LedgerShard.model_validate(x) for x in commit.get("shards", [])],
            [Rejection.model_validate(x) for x in commit.get("rejected", [])])


def round_close(run: Run, r: int, counted: bool = True) -> Close:
    """Round r's CLOSE as a reduction or a commit needs it (``screened``; ``counted`` False: as
    written, what its volunteer aggregators are assigned by): RunError while the round is open,
    or its shards' contents are not checked yet."""
    close = Close.read(run, r)
    if close is None:
        raise RunError(f"round {r} is not closed")
    return with_checks(run, close) if counted else close


def with_checks(run: Run, close: Close) -> Close:
    """``close`` as its shards are counted: where CLOSE left their contents to be checked after
    it (entries without a norm: volunteer aggregators check them, checks/exchange.py), amended by the
    scheduler's signed record of those checks (one GET): the shards they rejected moved to the
    rejected, with their reason, every norm known, the counted samples those left. RunError
    while that record is not written."""
    if all(e.norm is not None for e in close.accepted):
        return close
    r = close.round
    found = run.read_record(run.keys.screened(r), f"checks of round {r}'s shards", round=r)
    if found is None:
        raise RunError(f"round {r}: its shards' contents are not checked yet")
    out = [Rejection.model_validate(x) for x in found["rejected"]]
    gone = {x.key for x in out}
    return amend(close, [e.model_copy(update={"norm": found["norms"][e.key]})
                           for e in close.accepted if e.key not in gone], out)


def amend(close: Close, kept: list[Entry], out: list[Rejection]) -> Close:
    """``close`` with only ``kept`` accepted and ``out`` rejected besides, its counted samples
    those ``kept`` count for (their capped weights)."""
    samples = close.samples if not out else round(sum(e.weight if e.weight is not None else e.samples for e in kept))
    return close.model_copy(update={"accepted": kept, "samples": samples,
                                    "rejected": sorted(close.rejected + out, key=lambda x: x.key)})


def close_summary(close: Close) -> dict:
    """What a log line or an artifact says of a CLOSE (which lists every shard's checksums)."""
    return {"round": close.round, "samples": close.samples, "shards": len(close.accepted),
            "rejected": len(close.rejected), "reason": close.reason}
