"""The volunteer aggregators' standing, as the referee keeps it from round to round: what it
trusts, benches and audits whole, in the bucket (``RunLayout.standing``, signed) so a restarted
scheduler decides the same.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..protocol.run import Run

WHAT = "the aggregators' standing"


class Standing(BaseModel):
    """What the referee remembers of the aggregators from round to round, kept in the bucket
    (``RunLayout.standing``, signed) so a restarted scheduler trusts and benches the same: parts
    each person (its key) passed audits for, the last round each withholder sits out, and the last
    round every part is audited whole."""

    model_config = ConfigDict(extra="forbid")

    passed: dict[str, int] = {}
    benched: dict[str, int] = {}
    alert_until: int = -1


def read(run: Run) -> Standing:
    """The standing recorded (one GET); a fresh one where none is."""
    found = run.read_record(run.keys.standing, WHAT)
    return Standing.model_validate({k: v for k, v in (found or {}).items() if k in Standing.model_fields})


def keep(run: Run, standing: Standing, before: Standing) -> None:
    """Write ``standing`` if it changed since ``before`` (one PUT)."""
    if standing != before:
        run.bucket.write_json(run.keys.standing, run.record(WHAT, standing.model_dump()))
