"""The ledger: COMMIT of a state from its applied parts, the streams it counts, and pruning.

What a run keeps forever is its ledger (every CLOSE and COMMIT); what it keeps for a while is the
bulk data of recent states. ``commit`` writes state r+1's streams record and its COMMIT (once,
create-only: a second scheduler finds it written), then LATEST, then prunes what no one reads again.
"""

from __future__ import annotations

import logging
import statistics

from ..compute import optim
from ..protocol.close import Close, LedgerShard, round_close
from ..protocol.run import Run, RunError
from ..protocol.shard import Entry
from ..storage.layout import volunteer_of
from ..trust import identity

log = logging.getLogger(__name__)

LEDGER_FIELDS = set(LedgerShard.model_fields)  # of each accepted shard's CLOSE entry, in COMMIT


def stream_ends(before: dict[str, int], close: Close) -> dict[str, int]:
    """Each stream's end, as of this round's shards, accepted or refused once known to be their
    peer's own, and the shards of the round before that missed its CLOSE (deterministic: safe to
    repeat)."""
    ends = dict(before)
    for data in [e.data for e in close.accepted] + [e.data for e in close.rejected + close.missed
                                                       if e.data is not None]:
        ends[data.stream] = max([ends.get(data.stream, 0)] + [a + c for a, c in data.ranges])
    return ends


def round_loss(accepted: list[Entry]) -> float:
    """The training loss a round reports: the median over volunteers of each one's loss (its
    shards' mean, by weight). A loss is a volunteer's claim, and in a weighted mean one shard
    claiming -1e30 would make the round's -2.5e29; the median of three or more volunteers stays
    between honest ones."""
    by_volunteer: dict[str, list[Entry]] = {}
    for e in accepted:
        by_volunteer.setdefault(volunteer_of(e.peer), []).append(e)
    return statistics.median(sum(e.weight * e.loss for e in mine) / sum(e.weight for e in mine)
                             for mine in by_volunteer.values())


def commit(run: Run, r: int, stages: dict[str, float] | None = None) -> dict:
    """COMMIT state r+1 from its applied parts (``stages``: how long the steps of ending its
    round took, ``close_out``), then prune what no one reads again."""
    c = _write_commit(run, r, stages)
    log.info("state %d committed: loss %.4f, %d samples, %d contributors", r + 1,
             c["loss"], c["samples"], len(c["contributors"]))
    prune(run, r + 1)
    return c


def _write_commit(run: Run, r: int, stages: dict[str, float] | None = None) -> dict:
    """COMMIT of state r+1 (once, create-only), then LATEST. Returns the COMMIT."""
    keys, bucket = run.keys, run.bucket
    try:
        existing = run.read_record(keys.commit(r + 1), f"COMMIT of state {r + 1}", state=r + 1)
    except identity.IdentityError as exc:  # whoever wrote it first, it is not the organizer's
        log.error("%s: deleted; committing the true one", exc)
        bucket.delete(keys.commit(r + 1))
        existing = None
    if existing is None:
        close = round_close(run, r)
        found = bucket.read_many([keys.applied(r + 1, k) for k in range(run.n_parts)])
        missing = [k for k, v in found.items() if v is None]
        if missing:
            raise RunError(f"state {r + 1}: parts not applied: {missing}")
        applied = [run.bucket.parsed(keys.applied(r + 1, k), found[keys.applied(r + 1, k)]) for k in range(run.n_parts)]
        delta_sums: dict[str, list[str]] = {}
        for a in applied:
            for name, s in a["checksums"]["delta"].items():
                delta_sums.setdefault(name, []).extend(s)
        shards = [e.model_dump(mode="json", include=LEDGER_FIELDS) for e in close.accepted]
        bucket.write_json(keys.streams(r + 1), run.record(f"streams of state {r + 1}", {
            "state": r + 1, "ends": stream_ends(run.stream_ends(r), close)}, state=r + 1))
        # the checks after CLOSE may leave no shard (checks/exchange.py): no loss measured, the last one stands
        loss = round_loss(close.accepted) if close.accepted else run.commit_of(r)["loss"]
        commit = {
            "state": r + 1, "round": r, "step": r + 1, "samples": close.samples,
            "loss": loss, "contributors": sorted({e.peer for e in close.accepted}), "shards": shards,
            "rejected": [e.dump() for e in close.rejected],
            "lr": optim.lr_at(run.config.aggregator_optimizer, r + 1),
            "opened_at": close.opened_at, "started_at": close.started_at, "closed_at": close.closed_at,
            "committed_at": run.clock.time(),
            "checksums": {"params": [s for a in applied for s in a["checksums"]["params"]],
                          "delta": delta_sums},
            "aggregated_by": [a.get("by", ["organizer"]) for a in applied],  # per part: who computed it
            **({"stages": stages} if stages else {}),  # seconds of each step from CLOSE to here (close_out)
        }
        if not bucket.create_json(keys.commit(r + 1), run.record(f"COMMIT of state {r + 1}", commit, state=r + 1)):
            log.info("state %d was committed by another scheduler", r + 1)
        existing = run.commit_of(r + 1)
    hint = run.latest_hint()
    if hint < r + 1 or hint > r + 1 and not bucket.exists(keys.commit(hint)):  # behind, or naming no state
        bucket.write_json(keys.latest, run.record("LATEST", {"state": r + 1}))
    return existing


def prune(run: Run, newest: int, window: int = 3) -> None:
    """Drop bulk data no peer or scheduler will read again once state ``newest`` is committed.

    Kept forever: every COMMIT and CLOSE (the ledger), and the parameters and optimizer state of
    every ``checkpoint_every``-th state. Kept whole: the last ``keep_states`` states and their
    rounds (the frozen shards the validator reads). In the volunteers' prefixes, only the
    ``LIVE_ROUNDS`` rounds from ``newest - 1`` (late shards fold one round later; restarted peers
    resume from their manifests): everything else there, keys off the layout too, goes, so the
    scheduler's one listing of them stays as short as the rounds it reads.
    """
    keys, bucket, cfg = run.keys, run.bucket, run.config
    bucket.delete(keys.volunteers_dir, only=lambda k: (w := keys.written(k)) is None or w.round < newest - 1)
    last = newest - cfg.keep_states
    # ``window`` states back once per process (a crash may have skipped some), then only new ones
    first = max(1, last - window) if run.pruned_through is None else run.pruned_through + 1
    run.pruned_through = max(last, run.pruned_through or 0)
    for s in range(first, last + 1):  # a listing each of the state and of its round
        checkpoint = (keys.params(s), keys.optim_dir(s)) if s % cfg.checkpoint_every == 0 else ()
        bucket.delete(keys.state(s), keep=(keys.commit(s), *checkpoint))
        bucket.delete(keys.round(s - 1), keep=(keys.close(s - 1),))
