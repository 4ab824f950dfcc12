"""The close's admission rules: which validated shards of a round count, and for how much.

Validation (``validation.py``) judges one shard by itself; these rules judge a shard among the
round's others: a volunteer's parts, the round's median norm, the flags, each volunteer's share
of the mean, and whether the round is full. Pure functions of CLOSE entries and config values,
so each rule is tested alone; the order the scheduler applies them in is ``catalog.AT_CLOSE``'s,
then ``weigh`` and ``met``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from ..protocol.close import Rejection
from ..protocol.shard import Entry
from ..storage.layout import volunteer_of
from ..trust import identity
from . import direction
from .flags import Flag, flag_of


def folded(late: list[Entry]) -> list[Entry]:
    """Shards of round r-1 that missed its CLOSE, as round r counts them (``late_shards="fold"``)."""
    return [e.model_copy(update={"late": True}) for e in late]


def bound_parts(accepted: list[Entry], max_parts: int) -> tuple[list[Entry], list[Rejection]]:
    """At most ``max_parts`` shards of a volunteer (all its peers together) count in a round, its
    first ones (a peer's late shards first, then part names, which start with their time), and no
    two of them over the same samples: many small parts would otherwise buy a volunteer rows in
    every median and a reduction that grows without bound, and a copy of a part its weight twice."""
    seen: dict[str, int] = {}
    used: dict[str, list[tuple[int, int]]] = {}
    kept, out = [], []
    for s in sorted(accepted, key=lambda s: (s.peer, s.late is False, s.part)):
        v, ranges = volunteer_of(s.peer), s.data.ranges
        mine = used.setdefault(s.peer, [])
        overlap = next(((a, c) for a, c in mine for b, d in ranges if a < b + d and b < a + c), None)
        seen[v] = seen.get(v, 0) + (overlap is None)
        if overlap is not None:
            out.append(Rejection(key=s.key, reason=f"samples {ranges[0][0]}.. of {s.peer} were already counted "
                                 f"this round by another part ({overlap[0]}+{overlap[1]})"))
        elif seen[v] > max_parts:
            out.append(Rejection(key=s.key, reason=f"part {seen[v]} of volunteer {v} this round, "
                                 f"above close.max_parts={max_parts}"))
        else:
            kept.append(s)
            mine.extend(ranges)
    return kept, out


def screened_norms(accepted: list[Entry]) -> tuple[dict[str, float], float]:
    """Each shard's norm as the norm screen compares it, and the round's median volunteer's: a
    mean over fewer samples is noisier (its norm grows like 1/sqrt(samples)), so norms are
    compared as if each shard had the typical shard's samples (never more). Both medians are over
    volunteers (each its shards' median), so one volunteer's many parts move them no more than one
    part would. Nothing with fewer than three volunteers."""
    by_volunteer: dict[str, list[Entry]] = {}
    accepted = [s for s in accepted if s.norm is not None]  # the others are screened after CLOSE (checks/exchange.py)
    for s in accepted:
        by_volunteer.setdefault(volunteer_of(s.peer), []).append(s)
    if len(by_volunteer) < 3:
        return {}, 0.0
    typical = float(np.median([np.median([s.samples for s in mine]) for mine in by_volunteer.values()]))
    scaled = {s.key: s.norm * math.sqrt(min(s.samples, typical) / typical) for s in accepted}
    return scaled, float(np.median([np.median([scaled[s.key] for s in mine]) for mine in by_volunteer.values()]))


def norm_screen(accepted: list[Entry], factor: float | None) -> tuple[list[Entry], list[Rejection]]:
    """Shards far above the round's median norm (``factor`` times it, ``screened_norms``), rejected:
    a gradient scaled up is the cheapest attack on a mean, and no absolute bound fits every stage
    of training. Off (``factor`` None) or with fewer than three volunteers, nothing is screened."""
    scaled, median = screened_norms(accepted) if factor is not None else ({}, 0.0)
    if not scaled:
        return accepted, []
    bound = factor * median
    kept, out = [], []
    for s in accepted:
        z = scaled.get(s.key)
        if z is None or z <= bound:  # None: not yet checked, screened after CLOSE
            kept.append(s)
        else:
            out.append(Rejection(key=s.key, reason=f"gradient norm {s.norm:.3g} ({z:.3g} at the typical shard's "
                                 f"samples) above {factor:g}x the round's median volunteer ({bound:.3g})"))
    return kept, out


def judge_contents(accepted: list[Entry], verdicts: dict[str, float | str], max_norm: float,
             factor: float | None) -> tuple[list[Entry], list[Rejection]]:
    """The shards whose contents were checked only after they were admitted (``verdicts``: each
    one's norm, or why its contents are refused), their norms set: those refused, above
    ``max_norm``, or far above the round's median volunteer (``screen``), rejected, with the
    samples their peers spent on them."""
    kept, out = [], []
    for s in accepted:
        v = verdicts.get(s.key, s.norm)
        if isinstance(v, str) or v is None:
            out.append(Rejection(key=s.key, reason=v or "its contents were not checked", data=s.data))
        elif v > max_norm:
            out.append(Rejection(key=s.key, reason=f"gradient norm {v:.3g} above the bound {max_norm:.3g}",
                                 data=s.data))
        else:
            kept.append(s.model_copy(update={"norm": v}))
    kept, screened = norm_screen(kept, factor)
    data = {s.key: s.data for s in accepted}
    return kept, out + [x.model_copy(update={"data": data[x.key]}) for x in screened]


def direction_screen(accepted: list[Entry], min_agreement: float | None) -> tuple[list[Entry], list[Rejection]]:
    """The direction screen (``direction.py``): the shards of a volunteer whose sketch (its
    shards', by samples) points away from the median volunteer's, cosine below ``min_agreement``,
    rejected. Only shards with a sketch (the local-steps mode's, not recomputed before CLOSE) are judged;
    off (None) or with fewer than three volunteers, nothing is."""
    if min_agreement is None:
        return accepted, []
    sketched: dict[str, np.ndarray] = {}
    for s in accepted:
        if s._sketch is not None:
            v = volunteer_of(s.peer)
            sketched[v] = sketched.get(v, 0.0) + s.samples * s._sketch
    cosines = direction.agreement(sketched)
    kept, out = [], []
    for s in accepted:
        cos = cosines.get(volunteer_of(s.peer))
        if cos is None or cos >= min_agreement:
            kept.append(s)
        else:
            out.append(Rejection(key=s.key, reason=f"points away from the round's median volunteer: cosine "
                                 f"{cos:.3f} of its sketch, below close.min_agreement={min_agreement:g}"))
    return kept, out


def unflagged(accepted: list[Entry], flags: dict[str, Flag],
              roster: identity.Roster | None = None) -> tuple[list[Entry], list[Rejection]]:
    """Shards of flagged volunteers (``flags``: volunteer -> its flag, ``flags.read``; with the
    ``roster``, also of any name enrolled with a flagged key) are refused, whenever they were
    uploaded."""
    kept, out = [], []
    for s in accepted:
        flag = flag_of(s.peer, flags, roster)
        if flag is None:
            kept.append(s)
        else:
            out.append(Rejection(key=s.key, reason=f"volunteer {flag.volunteer} was flagged by the "
                                 f"{flag.by} in round {flag.round}: {flag.reason}"))
    return kept, out


def present_volunteers(live: Iterable[str], previous: Iterable[str], opened_at: float, now: float,
            grace_s: float) -> frozenset[str]:
    """The volunteers present in a round besides those with shards in it: those heartbeating it
    (``live``), and for its first ``grace_s`` seconds (the run's ``peer_timeout_s``) those who
    contributed to the state it builds on (``previous``), whose heartbeats for it may not be in
    yet. Only they divide the target (``weigh``): a volunteer who left caps nobody for longer
    than a silent peer counts, so whoever is live can always fill the round."""
    return frozenset(live) | (frozenset(previous) if now - opened_at < grace_s else frozenset())


def least_volunteers(previous: Iterable[str], enrolled: int, started_at: float, now: float, grace_s: float) -> int:
    """How many volunteers a round counts at least (``weigh``): in a run's first round, whose
    state has no contributors to count as present (``present``), as many as are enrolled, up to
    three, for the first ``grace_s`` seconds after its first work (``started_at``); else none.
    Otherwise whoever is quickest (a shard claiming the whole target for 8 samples of work) fills
    it before the others' first heartbeats. Counted among three, one volunteer alone weighs two
    thirds of the target, and only until the grace passes: a volunteer alone still fills the
    round, and three volunteers keep their exact weights. An unsigned run has no roster: anyone
    can be any number of volunteers there, and the caps bound mistakes, not attacks."""
    return min(3, enrolled) if not list(previous) and now - started_at < grace_s else 0


class Weighed(NamedTuple):
    entries: list[Entry]  # with their weights
    samples: int  # the round's counted samples
    cap: int  # the most one volunteer counts for now (the round view publishes it)


def weigh(accepted: list[Entry], target: int, max_share: float, others: Iterable[str] = (),
          least: int = 0) -> Weighed:
    """Each shard's weight in the mean and the round's counted samples. Claimed samples are
    claims: uncapped, one shard claiming 10,000 samples takes 99.8% of the mean and fills a round
    alone. So a volunteer counts for at most twice its fair share of the target (2/V, V the
    volunteers of this round and ``others``: those ``present`` without a shard yet) or twice the
    round's median volunteer, whichever is more, and never less than ``max_share`` of the target;
    its parts are scaled down alike. So the first shard of a round, or of a run, is capped by the
    peers still computing theirs, or by those a run's first round awaits (``least``). Honest
    volunteers within that keep their exact weights (N peers still equal one process), and one or
    two volunteers are never capped: a volunteer alone fills its round."""
    claimed: dict[str, int] = {}
    for s in accepted:
        claimed[volunteer_of(s.peer)] = claimed.get(volunteer_of(s.peer), 0) + s.samples
    active = set(claimed) | set(others)  # those not in yet count 0 in the median
    counts = [claimed.get(v, 0) for v in active]
    counts += [0] * (least - len(counts))  # awaited volunteers: not in yet
    median = float(np.median(counts)) if counts else 0.0
    cap = math.ceil(max(target * max_share, 2 * target / max(len(counts), 1), 2 * median))
    weighted = [s.model_copy(update={"weight": s.samples * min(1.0, cap / claimed[volunteer_of(s.peer)])})
                for s in accepted]
    return Weighed(weighted, sum(min(n, cap) for n in claimed.values()), cap)


def timed_out(opened_at: float, now: float, timeout_s: float | None) -> bool:
    """The round has been open ``timeout_s`` (None: never times out)."""
    return timeout_s is not None and now - opened_at >= timeout_s


def closes(samples: int, target: int, min_fraction: float, expired: bool) -> bool:
    """The close rule: the target reached, or, once the round ``expired`` (``timed_out``), ``min_fraction`` of it."""
    return samples >= target or (expired and samples >= min_fraction * target)
