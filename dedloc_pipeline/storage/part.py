"""A shard's part name: when it was made, in milliseconds, and 6 random hex digits.

Fixed width, so a volunteer's bucket grant can spell its shard keys with one IAM ``?`` per
character (``trust/policy.py``), and ordered by time, so a peer's parts of a round list in the
order it made them.
"""

from __future__ import annotations

import uuid

MS_DIGITS = 13  # milliseconds since the epoch: 13 digits until the year 2286
TOKEN_HEX = 6  # two parts of one peer in the same millisecond still differ


def name(t: float) -> str:
    """The part name of a shard made at ``t`` (seconds since the epoch)."""
    return f"{int(t * 1000):0{MS_DIGITS}d}-{uuid.uuid4().hex[:TOKEN_HEX]}"
