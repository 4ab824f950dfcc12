"""A volunteer's own uploads against the COMMITs that counted, rejected or missed them (its side of the ledger)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol.close import committed

if TYPE_CHECKING:
    from ..protocol.run import Run


class Uploads:
    """This peer's shards as the COMMITs record them: counted, rejected (why), missed (arrived
    after the round closed) or open (the round is not committed yet). A verdict is final once
    its COMMIT exists, so each COMMIT is read once."""

    def __init__(self, run: Run):
        self.run = run
        self._final: dict[str, tuple[str, str | None]] = {}  # shard key -> (verdict, reason)

    def tally(self, uploads, state: int) -> dict:
        """Samples per verdict over ``uploads`` ((round, key, samples)), given committed ``state``."""
        fold = self.run.config.close.late_shards == "fold"  # a late shard counts one round later
        commits: dict[int, dict | None] = {}
        out = {"counted": 0, "counted_shards": 0, "open": 0, "missed": 0, "rejected": []}
        for r, key, samples in uploads:
            verdict, reason = self._final.get(key) or self._verdict(r, key, fold, state, commits)
            if verdict != "open":
                self._final[key] = (verdict, reason)
            if verdict == "rejected":
                out["rejected"].append({"key": key, "round": r, "samples": samples, "reason": reason})
            else:
                out[verdict] += samples
                out["counted_shards"] += verdict == "counted"
        return out

    def _verdict(self, r: int, key: str, fold: bool, state: int, commits: dict) -> tuple[str, str | None]:
        for s in (r + 1, r + 2) if fold else (r + 1,):
            if s > state:
                return "open", None
            if s not in commits:
                commits[s] = self.run.bucket.read_json(self.run.keys.commit(s))
            c = commits[s]
            if c is None:
                return "open", None
            accepted, rejected = committed(c)
            if any(x.key == key for x in accepted):
                return "counted", None
            reason = next((x.reason for x in rejected if x.key == key), None)
            if reason is not None:
                return "rejected", reason
        return "missed", None
