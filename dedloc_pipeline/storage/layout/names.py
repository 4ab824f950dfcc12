"""The layout's version and names: peer ids, volunteer names, shard parts and numbered entries."""

from __future__ import annotations

import re

# 2: quantized codes stored zigzag-folded as uint8; 3: no zarr.json for any vector (its metadata
# follows from run.json), a shard's codes and scales in one object, shards validated and read in
# a frozen copy, and a signed run's organizer records (run.json too) name their run and place;
# 4: everything a volunteer writes under one prefix of its own, volunteers/{peer}/
LAYOUT_VERSION = 4
PEER_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # peer ids and shard parts: one key segment each


def is_name(value: object) -> bool:
    """The one rule for peer ids, volunteer names and shard parts: the whole string matches
    PEER_ID (``re.match`` would let ``bob\n`` through: ``$`` matches before a final newline)."""
    return isinstance(value, str) and re.fullmatch(PEER_ID, value) is not None


def name_problem(value: object, what: str = "peer id") -> str | None:
    """Why ``value`` cannot be a peer id or volunteer name (None: it can): the one check every
    command makes alike (worker, enroll, policy)."""
    return None if is_name(value) else f"{what} {value!r} must match {PEER_ID}"


def volunteer_of(peer: str) -> str:
    """The volunteer a peer id belongs to (``NAME`` or ``NAME.anything``): what a key is enrolled
    for, and what influence is bounded per (one volunteer may run many peers)."""
    return peer.split(".", 1)[0]


NUMBER = re.compile(r"\d{8}")
PART = re.compile(r"\d{5}\.json")  # an aggregator part's record
EXCHANGES = {"screens": ("screen_claim", "screen"), "sums": ("sum_claim", "sums")}  # folder: its kinds
STATE_CHUNK = re.compile(r"(?:params|delta|optim/[^/]+)/[^/]+/c/(\d+)")  # a state vector's chunk object


def numbered(i: int) -> str:
    """A number as keys spell it: 8 digits, so listings sort in order."""
    return f"{i:08d}"

