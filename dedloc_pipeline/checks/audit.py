"""Audits: what two volunteer aggregators agreed on is recomputed by the organizer on chunks
nobody could know in advance, before it counts (docs/aggregators.md, "Audits").

Two names may be one person, so two agreeing answers prove nothing by themselves. Each part an
exchange settles by agreement (the checks of the shards, LAMB's partial sums, the answer) is
audited: the organizer recomputes a share of its chunks (``close.audit``, one chunk at least;
every chunk where an aggregator has not earned trust yet, or after a lie was caught) from the
frozen shards and state r with ranged reads, and for an answer also reads the objects of those
chunks and decodes them. Every value is per chunk and the same bits whatever chunks are computed
together (``aggregation``), so a chunk's recomputation either equals the claim or proves a lie.

The draw: the organizer's signature over the run, the round and the CLOSE's seed (Ed25519
signatures are deterministic, so a restarted scheduler draws the same), hashed with each part
and chunk. Nobody but the organizer can compute it before the round's audit record publishes
it, and anyone can check it then with the organizer's public key. A lie that changes c of a
part's n chunks survives an audit of a of them with probability C(n-c, a) / C(n, a)
(``draw.survival``): a lie over a whole part never does.
"""

from __future__ import annotations

import base64

from ..compute import aggregation
from ..protocol.close import Close
from ..protocol.run import Run
from ..storage import vector
from ..trust import identity
from . import exchange


def _signed(run: Run, close: Close) -> dict:
    """What the organizer signs to draw round ``close.round``'s audits: its run, round and CLOSE."""
    return {"audit": run.name, "round": close.round, "seed": exchange.seed(close)}


def secret(run: Run, close: Close) -> str:
    """What round ``close.round``'s draw is seeded by: the organizer's signature over ``_signed``
    (base64), published in the round's audit record once the round is settled."""
    return base64.b64encode(run.organizer("the audits' draw").sign(identity.canonical(_signed(run, close)))).decode()


def check_secret(run: Run, close: Close, drawn_by: str) -> bool:
    """Whether ``drawn_by`` is the organizer's secret for this round (anyone can check a draw)."""
    return identity.verify(run.config.organizer_key, _signed(run, close), drawn_by)


def screen(run: Run, close: Close, part: int, chunks: list[int], claimed: list[list[float]]) -> str | None:
    """Why the checks of the shards claimed for ``part`` are not the organizer's in ``chunks``
    (None: they are). Only the shards claimed sound are recomputed: one claimed unsound is
    judged again whole (``referee._rejudge``)."""
    start = run.part_chunks(part).start
    sound = [(i, e) for i, e in enumerate(close.accepted) if min(claimed[i]) >= 0]
    shards = [e for _, e in sound]
    for c in chunks:
        span = range(c, c + 1)
        mine = aggregation.part_checks(run, part, shards, aggregation.read_part(run, shards, part, span), span)
        for (i, e), value in zip(sound, mine):
            if value[0] != claimed[i][c - start]:
                return f"shard {e.key} in chunk {c}: {claimed[i][c - start]} claimed, {value[0]} recomputed"
    return None


def sums(run: Run, close: Close, part: int, chunks: list[int], claimed: list[dict]) -> str | None:
    """LAMB: why the partial sums claimed for ``part`` are not the organizer's in ``chunks``."""
    r, start = close.round, run.part_chunks(part).start
    for c in chunks:
        span = range(c, c + 1)
        grad = aggregation.mean_gradient(run, r, part, chunks=span)
        if (mine := aggregation.part_sums(run, r, part, grad, chunks=span)[0]) != claimed[c - start]:
            return f"the partial sums of chunk {c}: {claimed[c - start]} claimed, {mine} recomputed"
    return None


def answer(run: Run, close: Close, part: int, chunks: list[int], claimed: dict[str, dict[str, list[str]]],
           base: str) -> str | None:
    """Why the answer claimed for ``part`` (its vectors' chunk checksums, its objects below
    ``base``) is not the organizer's step in ``chunks``: a checksum other than the organizer's
    recomputation, or objects whose bytes are not those checksums (None: it is)."""
    r, start, formats = close.round, run.part_chunks(part).start, aggregation.next_formats(run)
    norms = aggregation.norms(run, r) if run.config.aggregator_optimizer.name == "lamb" else None
    for c in chunks:
        span, i = range(c, c + 1), c - start
        grad = aggregation.mean_gradient(run, r, part, chunks=span)
        for name, arrays in aggregation.next_part(run, r, part, grad, norms, chunks=span).items():
            theirs = {a: sums[i:i + 1] for a, sums in claimed[name].items()}
            if vector.chunk_checksums(formats[name], arrays, span) != theirs:
                return f"its {name} in chunk {c} is not the organizer's recomputation"
            placed = {a: [""] * start + sums for a, sums in claimed[name].items()}  # indexed by chunk
            found = vector.read_vectors(run.bucket, [aggregation.vector_key(base, name)], formats[name], span,
                                        [placed])[0]
            if isinstance(found, vector.CorruptShard):
                return f"its {name} objects of chunk {c} are not the bytes of its checksums"
    return None
