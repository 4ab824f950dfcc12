"""Verified work: a trusted validator recomputes a random share of the accepted shards and compares.

A shard is a claim: "on state r, over samples ``data`` of my own stream, the mean gradient is
this". Validation at close (shard.py) checks everything a claim says about itself; only
recomputing it checks the gradient. A validator (any trusted machine: it needs the run's reads and
the right to write its records) follows the committed rounds and, for each:

- chooses shards with randomness no volunteer can predict before its upload and anyone can
  recompute afterwards: COMMIT r+1's hash, which depends on every accepted shard of round r
  (``chosen``). A volunteer cannot know whether its shard will be checked, so a cheater is
  caught, in expectation, after ``1 / (fraction * detection)`` of its shards;
- recomputes each chosen shard's mean gradient on the samples it names (its first
  ``stale_samples`` on state r-1, the rest on state r, as the worker computed them), or in the
  local-steps mode replays its inner steps to its pseudo-gradient, and compares cosine and norm
  ratio with the decoded shard (``recompute.py``: ``Recomputer``, ``tolerance``);
- screens every pair of accepted shards of different volunteers for near-identical gradients,
  and sparse shards also for near-identical kept positions (``similarities``: sums chunk by
  chunk, memory bounded), and recomputes both of a suspicious pair: the copy is the one whose
  claimed data does not give its gradient (where both pass their tolerance, as a sparse copy can,
  the one ``Tolerance.short_of`` the other). Time stamps
  would not do: ``created_at`` is the volunteer's own claim, and a copier could back-date it to
  have the original flagged;
- holds a shard that passes its tolerance but not its ``pair_cosine`` against one shard of
  another volunteer of its round (``_refer``): a sparse shard's tolerance must be loose (its
  volunteer's error feedback never leaves it), and next to an honest shard's replay, which sees
  the same round, work on other samples stands out;
- writes one record per round (``records.round``) and a flag per volunteer caught
  (``flags.py``), which the scheduler reads, and optionally revokes the
  volunteer's key (``revoke``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Literal

import numpy as np
from pydantic import BaseModel

from ..protocol.close import Close, with_checks
from ..protocol.run import Run
from ..protocol.shard import Entry, commit_hash
from ..storage.bucket import StorageError
from ..storage.layout import volunteer_of
from . import catalog
from .flags import Flag, raise_flag, revoke
from .recompute import (
    COPY_COSINE,
    COPY_OVERLAP,
    Recomputer,
    Tolerance,
    Unverifiable,
    read_shard,
    similarities,
    tolerance,
)

log = logging.getLogger(__name__)

class ShardVerdict(BaseModel):
    """The validator's verdict on one recomputed shard, as its round's record lists it: ``ok``,
    ``mismatch`` or ``copy`` (compared with its data; the last two flag its volunteer),
    ``skipped`` (pruned before the validator got to it) or ``unverified`` (anything else)."""

    key: str
    peer: str
    volunteer: str
    samples: int
    stale_samples: int
    cosine: float | None = None
    norm_ratio: float | None = None
    flag: bool = False
    verdict: Literal["ok", "mismatch", "copy", "skipped", "unverified"] = "unverified"
    reason: str = ""
    seconds: float = 0.0
    copy_of: str | None = None  # a copy's original
    why: str = ""  # why it was recomputed: chosen, copy screen, reference

    def dump(self) -> dict:
        return self.model_dump(mode="json", exclude={"copy_of"} if self.copy_of is None else set())


FRACTION = 0.05  # of a round's accepted shards (and at least AT_LEAST of them): docs/verification.md
AT_LEAST = 1


def draw(state_hash: str, shard_key: str) -> float:
    """The shard's number in [0, 1): blake2b of COMMIT r+1's hash and the shard's key."""
    digest = hashlib.blake2b(f"{state_hash}/{shard_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def chosen(accepted: list[Entry], state_hash: str, fraction: float = FRACTION, at_least: int = AT_LEAST) -> list[Entry]:
    """The accepted shards to recompute: each whose draw is below ``fraction``, and at least the
    ``at_least`` lowest draws (with few shards a round, ``fraction`` alone would leave most rounds
    unchecked; one shard costs about one average volunteer's work). ``state_hash``: commit_hash
    of COMMIT r+1."""
    ranked = sorted(accepted, key=lambda s: draw(state_hash, s.key))
    return [s for i, s in enumerate(ranked) if i < at_least or draw(state_hash, s.key) < fraction]


class Verifier:
    """Follows a run: each newly committed round is verified once (its record exists: skipped),
    so it can be killed and started again at any moment; a restart redoes only a round whose
    record it had not written, with the same choice (the same COMMIT)."""

    def __init__(self, run: Run, fraction: float = FRACTION, at_least: int = AT_LEAST, device: str | None = None,
                 micro_batch: int | None = None, poll_s: float = 5.0, revoke: bool = False,
                 tolerance: Tolerance | None = None, copy_cosine: float = COPY_COSINE,
                 copy_overlap: float | None = COPY_OVERLAP):
        """``revoke``: also revoke a flagged volunteer's key at once, with the run's organizer
        key (without it, flags only: the scheduler rejects a flagged volunteer's later shards).
        In a signed run the verdicts and flags are signed with that key. ``tolerance``: for every
        shard; default each shard's own (``recompute.tolerance``: the run's codec's, and in the
        local-steps mode the volunteer's precision's). ``copy_overlap``: the sparse shards' overlap
        of kept positions above which a pair is recomputed (None: not screened)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction {fraction} is not in [0, 1]")
        self.run, self.fraction, self.at_least, self.poll_s = run, fraction, at_least, poll_s
        self.tolerance = tolerance
        self.copy_cosine, self.copy_overlap = copy_cosine, copy_overlap
        self.revoke = revoke
        self.recompute = Recomputer(run, device, micro_batch)
        self.tally: Counter[str] = Counter()  # what this process's rounds counted (``counts``), for its summary

    def done(self, r: int) -> bool:
        return self.run.bucket.exists(self.run.keys.verdicts(r))

    def next_round(self) -> int:
        """The round after the newest one recorded (0 without records)."""
        keys = self.run.keys
        rounds = {keys.number_of(n) for n in self.run.bucket.list(keys.verdicts_dir)} - {None}
        return max(rounds, default=-1) + 1

    def verify_round(self, r: int) -> dict | None:
        """Verify committed round r and write its record; the existing record if there is one;
        None while state r+1 is not committed."""
        bucket, keys = self.run.bucket, self.run.keys
        existing = self.run.read_record(keys.verdicts(r), f"verdicts of round {r}", round=r)
        if existing is not None:
            return existing
        commit = self.run.read_record(keys.commit(r + 1), f"COMMIT of state {r + 1}", state=r + 1)
        close = Close.read(self.run, r)
        if commit is None or close is None:
            return None
        close = with_checks(self.run, close)  # committed: its shards' checks are recorded
        t0 = time.perf_counter()
        state_hash = commit_hash(commit)
        accepted = close.accepted
        picks = {s.key: "chosen" for s in chosen(accepted, state_hash, self.fraction, self.at_least)}
        verdicts: dict[str, ShardVerdict] = {}
        screen: dict = {}
        # the validator's checks, in the catalog's order (recomputation first: the states it needs
        # are loaded before later commits prune them)
        steps = {
            "recomputation": lambda: verdicts.update({e.key: self._judge(e) for e in accepted if e.key in picks}),
            "copy screen": lambda: screen.update(self._screen(accepted, verdicts, picks)),
            "reference pair": lambda: self._refer(accepted, verdicts, picks, state_hash)}
        for check in catalog.AFTER_COMMIT:
            steps[check.name]()
        record = {"round": r, "state_hash": state_hash, "fraction": self.fraction, "at_least": self.at_least,
                  "accepted": len(accepted), "codec": self.run.config.codec, "copy_cosine": self.copy_cosine,
                  "copy_overlap": self.copy_overlap,
                  "tolerance": asdict(self.tolerance or tolerance(self.run.config)),
                  "copy_screen": screen,
                  "shards": [verdicts[k].model_copy(update={"why": picks[k]}).dump() for k in sorted(verdicts)],
                  "seconds": time.perf_counter() - t0, "verified_at": self.run.clock.time()}
        for k in sorted(verdicts):
            if verdicts[k].flag:
                self._flag(r, verdicts[k])
        # last: a crash redoes the round
        bucket.create_json(keys.verdicts(r), self.run.record(f"verdicts of round {r}", record, round=r))
        n = counts(record["shards"])
        self.tally.update(n)
        log.info("round %d verified: %s", r, summary(n))
        return self.run.read_record(keys.verdicts(r), f"verdicts of round {r}", round=r)

    def _judge(self, entry: Entry) -> ShardVerdict:
        """One shard's verdict; any failure of one shard is that shard's verdict, never the loop's."""
        t0 = time.perf_counter()
        out = ShardVerdict(key=entry.key, peer=entry.peer, volunteer=volunteer_of(entry.peer), samples=entry.samples,
                           stale_samples=entry.stale_samples)
        try:
            recomputed = self.recompute.gradient(entry)
            tol = self.tolerance or tolerance(self.run.config, entry.precision)
            c = tol.compare(read_shard(self.run, entry), recomputed)
            ok = c.matches(tol)
            what = "pseudo-gradient replayed" if self.run.config.algorithm == "diloco" else "gradient recomputed"
            bound = "not checked" if tol.max_norm_error is None else f"1 +- {tol.max_norm_error}"
            out.cosine, out.norm_ratio = c.cosine, c.norm_ratio
            out.verdict, out.flag = "ok" if ok else "mismatch", not ok
            out.reason = "" if ok else (f"the {what} on its data differs: cosine {c.cosine:.6f} (at least "
                                        f"{tol.min_cosine}{', on its kept entries' if tol.kept_only else ''}), "
                                        f"norm ratio {c.norm_ratio:.4f} ({bound})")
        except Unverifiable as exc:
            out.verdict = "mismatch" if exc.fault else "skipped" if exc.pruned else "unverified"
            out.flag = exc.fault
            out.reason = f"skipped: {exc}" if exc.pruned and not exc.fault else f"could not be verified: {exc}"
        except StorageError:
            raise  # the bucket's fault: the loop retries the round later
        except Exception as exc:  # one input never stops the validator
            log.exception("shard %s could not be verified", entry.key)
            out.verdict, out.reason = "unverified", f"could not be verified: {type(exc).__name__}: {exc}"
        out.seconds = time.perf_counter() - t0
        return out

    def _screen(self, accepted: list[Entry], verdicts: dict[str, ShardVerdict], picks: dict[str, str]) -> dict:
        """Every pair of the round's shards (different volunteers) compared; both shards of a
        near-identical pair are recomputed, and the one whose data does not give its gradient is
        the copy."""
        if len({volunteer_of(s.peer) for s in accepted}) < 2:
            return {"pairs": [], "max_cosine": None}
        t0 = time.perf_counter()
        pairs = similarities(self.run, accepted)
        unreadable = [e.key for i, e in enumerate(accepted) if np.isnan(pairs.cosine[i, i])]
        cross = [(i, j) for i in range(len(accepted)) for j in range(i + 1, len(accepted))
                 if volunteer_of(accepted[i].peer) != volunteer_of(accepted[j].peer)
                 and not np.isnan(pairs.cosine[i, j])]
        found = []
        for i, j in pairs.suspects(accepted, self.copy_cosine, self.copy_overlap):
            a, b = accepted[i], accepted[j]
            for e in (a, b):
                if e.key not in verdicts:
                    picks[e.key] = "copy screen"
                    verdicts[e.key] = self._judge(e)
            seen = f"cosine {pairs.cosine[i, j]:.4f}"
            if pairs.overlap is not None:
                seen += f", kept positions overlap {pairs.overlap[i, j]:.3f}"
            found.append({"shards": [a.key, b.key], "cosine": float(pairs.cosine[i, j]),
                          **({} if pairs.overlap is None else {"overlap": float(pairs.overlap[i, j])})})
            for e, other in self._copies(a, b, verdicts):
                v = verdicts[e.key]
                v.verdict, v.flag, v.copy_of = "copy", True, other.key
                v.reason = f"copy of {other.key} ({seen}); {v.reason}"
        out = {"pairs": found, "max_cosine": max((float(pairs.cosine[i, j]) for i, j in cross), default=None),
               "seconds": time.perf_counter() - t0}
        if pairs.overlap is not None:
            out["max_overlap"] = max((float(pairs.overlap[i, j]) for i, j in cross), default=None)
        return {**out, "unreadable": unreadable} if unreadable else out

    def _copies(self, a: Entry, b: Entry, verdicts: dict[str, ShardVerdict]) -> list[tuple[Entry, Entry]]:
        """(copy, original) of a suspect pair: each that does not match its replay; if both do
        (a sparse copy can: its tolerance is loose), the one ``_short_of`` the other. A shard
        already called a copy in another pair stays one."""
        if any(verdicts[e.key].verdict == "copy" for e in (a, b)):
            return []
        mismatched = [(e, o) for e, o in ((a, b), (b, a)) if verdicts[e.key].verdict == "mismatch"]
        if mismatched:
            return mismatched
        for e, o in ((a, b), (b, a)):
            why = self._short_of(e, verdicts[e.key], verdicts[o.key])
            if why:
                verdicts[e.key].reason = why
                return [(e, o)]
        return []

    def _refer(self, accepted: list[Entry], verdicts: dict[str, ShardVerdict], picks: dict[str, str],
               state_hash: str) -> None:
        """Each judged shard that passes its tolerance but not its ``pair_cosine`` (sparse: a
        copy's or poisoned work's) is held against one shard of another volunteer of its round:
        one judged already, or else the next one drawn (one more replay at most)."""
        ranked = sorted(accepted, key=lambda s: draw(state_hash, s.key))
        for e in [s for s in ranked if s.key in verdicts]:
            v, bound = verdicts[e.key], (self.tolerance or tolerance(self.run.config, e.precision)).pair_cosine
            if v.verdict != "ok" or bound is None or v.cosine >= bound:
                continue
            others = [s for s in ranked if volunteer_of(s.peer) != volunteer_of(e.peer)]
            ref = next((s for s in others if s.key in verdicts and self._short_of(e, v, verdicts[s.key])), None)
            if ref is None:
                ref = next((s for s in others if s.key not in verdicts), None)
                if ref is None:
                    continue
                picks[ref.key], verdicts[ref.key] = "reference", self._judge(ref)
            why = self._short_of(e, v, verdicts[ref.key])
            if why:
                v.verdict, v.flag, v.reason = "mismatch", True, why

    def _short_of(self, e: Entry, v: ShardVerdict, ref: ShardVerdict) -> str | None:
        """Why shard ``e`` (verdict ``v``, ok by its tolerance) does not match beside ``ref``, a
        shard of another volunteer of its round (``Tolerance.short_of``); None: it matches."""
        tol = self.tolerance or tolerance(self.run.config, e.precision)
        if v.verdict != "ok" or ref.verdict != "ok" or not tol.short_of(v.cosine, ref.cosine):
            return None
        return (f"its replay's cosine{' on its kept entries' if tol.kept_only else ''} {v.cosine:.4f} is below "
                f"{tol.pair_cosine} and {tol.pair_spread:g}x as far from 1 as that of {ref.key}, of another "
                f"volunteer, {ref.cosine:.4f}")

    def _flag(self, r: int, v: ShardVerdict) -> None:
        """The volunteer's flag (its first caught shard is kept), then its key revoked if the
        organizer's key was given."""
        raise_flag(self.run, Flag(volunteer=v.volunteer, peer=v.peer, round=r, shard=v.key, verdict=v.verdict,
                                  reason=v.reason, cosine=v.cosine, norm_ratio=v.norm_ratio,
                                  flagged_at=self.run.clock.time()))
        if self.revoke:
            revoke(self.run, self.run.organizer("roster"), v.volunteer)

    def serve(self, until_round: int | None = None, stop: Callable[[], bool] | None = None) -> int:
        """Verify every round from the one after the newest record as it is committed, until
        round ``until_round`` is verified (or ``stop()``); returns the next round to verify."""
        r = self.next_round()
        while until_round is None or r <= until_round:
            if stop is not None and stop():
                break
            try:
                record = self.verify_round(r)
            except StorageError as exc:
                log.warning("round %d: the bucket failed (%s); trying again", r, exc)
                record = None
            if record is not None:
                r += 1
                continue
            if self.run.stopped() and not self.run.bucket.exists(self.run.keys.close(r)):
                break
            self.run.clock.sleep(self.poll_s)
        return r


def counts(shards: list[dict]) -> dict[str, int]:
    """A round's verdicts counted: recomputed (compared with the data, ``ok`` or ``mismatch``),
    flagged, skipped (pruned before the validator got to them) and unverified (anything else)."""
    v = Counter(x.get("verdict") for x in shards)
    return {"recomputed": v["ok"] + v["mismatch"], "flagged": sum(bool(x.get("flag")) for x in shards),
            "skipped": v["skipped"], "unverified": v["unverified"]}


def summary(n: dict[str, int]) -> str:
    return (f"{n.get('recomputed', 0)} shards recomputed, {n.get('flagged', 0)} flagged, "
            f"{n.get('skipped', 0)} skipped (pruned), {n.get('unverified', 0)} unverified")


def ended(last: int, n: dict[str, int]) -> str:
    """The validator's last line: up to which round it checked, and what; where it recomputed
    nothing, that it verified nothing, and why."""
    if n.get("recomputed", 0) or not (n.get("skipped", 0) or n.get("unverified", 0)):
        return f"verified up to round {last}: {summary(n)}"
    why = ("the states its shards were computed on were pruned before it read them: run it beside the "
           "scheduler, or keep more states (keep_states)") if n.get("skipped", 0) else "see the log above"
    return f"nothing verified up to round {last} ({summary(n)}): {why}"
