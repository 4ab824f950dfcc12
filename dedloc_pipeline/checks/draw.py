"""The audits' draw (``audit.py``): which chunks of a part are recomputed, and what that leaves
a lie. Arithmetic only, so what prices the audits (``dedloc cost``) needs no model.
"""

from __future__ import annotations

import hashlib
import math


def count(n: int, fraction: float) -> int:
    """How many of a part's ``n`` chunks an audit of ``fraction`` recomputes: rounded up, one at least."""
    return min(n, max(1, math.ceil(fraction * n - 1e-9)))


def draw(drawn_by: str, part: int, chunks: range, fraction: float) -> list[int]:
    """The chunks of ``part`` (``chunks``) audited (``count`` of them), ranked by a hash of the
    secret, the part and the chunk."""
    a = count(len(chunks), fraction)
    ranked = sorted(chunks, key=lambda c: hashlib.sha256(f"{drawn_by}/{part}/{c}".encode()).hexdigest())
    return sorted(ranked[:a])


def survival(n: int, a: int, c: int) -> float:
    """The chance that a lie changing ``c`` of a part's ``n`` chunks survives an audit of ``a``."""
    return math.comb(n - c, a) / math.comb(n, a) if c <= n - a else 0.0
