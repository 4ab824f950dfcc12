"""The round's latency budget, stage by stage (benchmarks 1 and 6): from the moment a round's
target is reached to the moment every volunteer holds the next state.

A round's target is reached when the manifest that brings its admitted samples to the target
lands (the manifests' ``created_at``, in landing order). Then, by the records and heartbeats a
collaboration leaves in its bucket (one machine, so one clock):

- ``close``: until CLOSE (the scheduler's poll wait, the judging of the shards, CLOSE written);
- ``settle``, ``reduce``, ``apply``, ``judge``: the organizer's steps (the COMMIT's ``stages``);
- ``commit``: the rest until ``committed_at`` (the ledger's reads before COMMIT);
- ``publish``: until the round view names the new state (COMMIT and LATEST written, the
  scheduler's next poll);
- ``poll``: until a volunteer reads that view (its poll's wait), per volunteer;
- ``download``: until it holds the state (the delta read and applied), per volunteer.

Each volunteer's heartbeat carries its last states' times (``Heartbeat.held``), so ``Recorder``
reads the newest heartbeats as the collaboration runs, and the manifests of each round once it
closes (volunteers' prefixes are pruned a few rounds later); CLOSE and COMMIT stay forever.
"""

from __future__ import annotations

import statistics

from dedloc_pipeline.protocol import heartbeat

from . import tables

STAGES = ("close", "settle", "reduce", "apply", "judge", "commit", "publish", "poll", "download")
ORGANIZER = STAGES[:7]  # once a round; the rest once per volunteer


class Recorder:
    """What a running collaboration's bucket says about each round's latency, read as it runs."""

    def __init__(self, bucket, keys, peers: list[str]) -> None:
        self.bucket, self.keys, self.peers = bucket, keys, peers
        self.held: dict[tuple[str, int], tuple[float | None, float, float]] = {}  # (peer, state) -> times
        self.filled: dict[int, float] = {}  # round -> when its target was reached
        self.upload_s: dict[str, list[float]] = {p: [] for p in peers}

    def observe(self) -> None:
        """Read the newest heartbeats, and the manifests of every round closed since the last call."""
        written = {k: self.keys.written(k) for k in self.bucket.find(self.keys.volunteers_dir)}
        progress = [k for k, w in written.items() if w is not None and w.kind == "progress"]
        for raw in self.bucket.read_many(progress).values():
            beat = heartbeat.parse(raw)
            if beat is None or beat.peer not in self.peers:
                continue
            for state, named, seen, held in beat.held:
                self.held.setdefault((beat.peer, state), (named, seen, held))
            if beat.upload_s and beat.upload_s not in self.upload_s[beat.peer][-1:]:
                self.upload_s[beat.peer].append(beat.upload_s)
        r = max(self.filled, default=-1) + 1
        while (close := self.bucket.read_json(self.keys.close(r))) is not None:
            self.filled[r] = _filled(self.bucket, self.keys, close)
            r += 1

    def budget(self, run, first: int, last: int) -> dict:
        """Rounds ``first`` to ``last`` (states ``first + 1`` to ``last + 1``), stage by stage:
        each round's seconds, and over the rounds (and volunteers) the median and the worst."""
        rounds = []
        for r in range(first, last + 1):
            commit, close = run.commit_of(r + 1), self.bucket.read_json(self.keys.close(r))
            stages = commit.get("stages", {})
            organizer = sum(stages.values())
            held = {p: self.held[(p, r + 1)] for p in self.peers if (p, r + 1) in self.held}
            named = [n for n, _, _ in held.values() if n is not None]
            row = {"round": r, "samples": commit["samples"], "overshoot": commit["samples"] / close["target"] - 1,
                   "close": close["closed_at"] - self.filled[r],
                   **{s: stages.get(f"{s}_s", 0.0) for s in ("settle", "reduce", "apply", "judge")},
                   "commit": commit["committed_at"] - close["closed_at"] - organizer,
                   "publish": min(named) - commit["committed_at"] if named else None,
                   "poll": [seen - n for n, seen, _ in held.values() if n is not None],
                   "download": [h - seen for _, seen, h in held.values()],
                   "total": [h - self.filled[r] for _, _, h in held.values()]}
            rounds.append(row)
        summary = {}
        for stage in (*STAGES, "total", "overshoot"):
            values = [v for row in rounds for v in (row[stage] if isinstance(row[stage], list) else [row[stage]])
                      if v is not None]
            summary[stage] = {"median": statistics.median(values), "worst": max(values)} if values else None
        uploads = [u for us in self.upload_s.values() for u in us]
        summary["upload"] = {"median": statistics.median(uploads), "worst": max(uploads)} if uploads else None
        return {"stages": summary, "rounds": rounds}


def _filled(bucket, keys, close: dict) -> float:
    """When round ``close``'s target was reached: the landing of the manifest that brought its
    admitted samples there (the last one, if it closed short)."""
    landed = []
    for entry in close["accepted"]:
        manifest = bucket.read_json(keys.manifest(entry["key"]))
        if manifest is not None:
            landed.append((manifest["created_at"], entry["weight"] or entry["samples"]))
    landed.sort()
    total = 0.0
    for at, samples in landed:
        total += samples
        if total >= close["target"]:
            return at
    return landed[-1][0] if landed else close["closed_at"]


def table(title: str, budgets: dict[str, dict]):
    """A row per stage, a pair of columns (median, worst seconds) per collaboration measured."""
    rows = []
    for stage in (*STAGES, "total", "upload", "overshoot"):
        label = {"total": "total: target reached to state held", "upload": "(a shard's upload)",
                 "overshoot": "(overshoot: samples over the target)"}.get(stage, stage)
        cells = [b["stages"][stage][k] if b["stages"].get(stage) else "-" for b in budgets.values()
                 for k in ("median", "worst")]
        rows.append([label, *cells])
    columns = ["stage", *(f"{name} {k}" for name in budgets for k in ("median", "worst"))]
    return tables.table(title, columns, rows)
