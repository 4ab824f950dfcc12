"""Keys under ``runs/{run}/`` the organizer writes: the run's records, its states and its rounds."""

from __future__ import annotations

from .names import NUMBER, PART, numbered
from .volunteers import VolunteerKeys


class RunLayout(VolunteerKeys):
    """Keys under ``runs/{run}/`` (docs/design.md, "Bucket layout")."""

    def __init__(self, run: str):
        self.run = run
        self.root = f"runs/{run}"

    # run-wide
    @property
    def config(self) -> str:
        return f"{self.root}/run.json"

    @property
    def rosters(self) -> str:
        """Every roster version ever signed, create-once: what a replayed ROSTER.json is checked
        against, by a scheduler started after the replay too."""
        return f"{self.root}/roster"

    def roster_version(self, version: int) -> str:
        return f"{self.rosters}/{numbered(version)}.json"

    @property
    def roster(self) -> str:
        """The organizer-signed list of enrolled and revoked volunteer keys (identity.py)."""
        return f"{self.root}/ROSTER.json"

    @property
    def latest(self) -> str:
        """A hint: ``{"state": s}``, the newest committed state when it was written."""
        return f"{self.root}/state/LATEST.json"

    @property
    def view(self) -> str:
        """The round view the scheduler publishes each poll (protocol/view.py): state, validated
        and pending samples, closed, stopped. All a volunteer reads per poll; only the organizer writes it."""
        return f"{self.root}/VIEW.json"

    @property
    def states(self) -> str:
        return f"{self.root}/state"

    @staticmethod
    def state_number(name: str) -> int | None:
        """The state an entry of the ``states`` listing is, or None (LATEST.json, debris)."""
        return int(name) if NUMBER.fullmatch(name) else None

    # state s: what round s's gradients are computed against
    def state(self, s: int) -> str:
        return f"{self.root}/state/{numbered(s)}"

    def params(self, s: int) -> str:
        return f"{self.state(s)}/params"

    def delta(self, s: int) -> str:
        """Compressed difference state s - state (s-1): what a synced peer downloads."""
        return f"{self.state(s)}/delta"

    def optim_dir(self, s: int) -> str:
        return f"{self.state(s)}/optim"

    def optim(self, s: int, name: str) -> str:
        return f"{self.optim_dir(s)}/{name}"

    def applied_dir(self, s: int) -> str:
        return f"{self.state(s)}/applied"

    def applied(self, s: int, part: int) -> str:
        """Marker: the aggregator of chunk range ``part`` wrote its slice of state s."""
        return f"{self.applied_dir(s)}/{part:05d}.json"

    def streams(self, s: int) -> str:
        """How far each peer's data stream is counted in states up to s: where a returning peer
        continues (manifests are pruned with their rounds; this is written with each commit)."""
        return f"{self.state(s)}/streams.json"

    def commit(self, s: int) -> str:
        return f"{self.state(s)}/COMMIT.json"

    # round r: gradients computed against state r
    @property
    def rounds_dir(self) -> str:
        return f"{self.root}/rounds"

    def round(self, r: int) -> str:
        return f"{self.rounds_dir}/{numbered(r)}"

    def frozen(self, shard: str) -> str:
        """The copy of a shard the scheduler validates, and everyone after it reads:
        ``rounds/R/frozen/PEER/PART``, which only the organizer writes, so nothing its volunteer
        does to the shard afterwards changes or stalls the round."""
        r, peer, part = self.shard_parts(shard)
        return f"{self.round(r)}/frozen/{peer}/{part}"

    def close(self, r: int) -> str:
        return f"{self.round(r)}/CLOSE.json"

    def sealed_claims(self, r: int) -> str:
        """The aggregators' claims of round r as the scheduler read them before it let them reveal
        (checks/exchange.py): what their results are held to, by a scheduler restarted after too."""
        return f"{self.round(r)}/claims.json"

    def sealed_screens(self, r: int) -> str:
        """The aggregators' claims of their checks of round r's shards, sealed before their reveal."""
        return f"{self.round(r)}/screen_claims.json"

    def screened(self, r: int) -> str:
        """Round r's shards as checked after CLOSE: which the checks rejected, and every norm (checks/exchange.py)."""
        return f"{self.round(r)}/screened.json"

    def sealed_sums(self, r: int) -> str:
        """LAMB: the aggregators' claims of round r's partial sums, sealed before their reveal."""
        return f"{self.round(r)}/sum_claims.json"

    def norms(self, r: int) -> str:
        """LAMB: round r's merged partial sums, which every part's step takes (checks/exchange.py)."""
        return f"{self.round(r)}/norms.json"

    def audits(self, r: int) -> str:
        """Round r's audits of what its volunteer aggregators agreed on: the organizer's secret
        that drew the chunks recomputed, which, and what was found (checks/audit.py)."""
        return f"{self.round(r)}/audits.json"

    def reduced_dir(self, r: int) -> str:
        """Scratch of round r's reduction: anything here means it has begun."""
        return f"{self.round(r)}/reduced"

    def reduced(self, r: int) -> str:
        """Scratch: the round's mean gradient, written range by range by the aggregators."""
        return f"{self.reduced_dir(r)}/grad"

    def reduced_marker(self, r: int, part: int) -> str:
        return f"{self.reduced_dir(r)}/{part:05d}.json"

    @property
    def verdicts_dir(self) -> str:
        return f"{self.root}/verify"

    def verdicts(self, r: int) -> str:
        """The validator's verdicts on round r's recomputed shards (verify.py): written once, last."""
        return f"{self.verdicts_dir}/{numbered(r)}.json"

    @staticmethod
    def number_of(name: str) -> int | None:
        """The number an ``NNNNNNNN.json`` entry of a listing stands for (a roster version, a
        verified round); None for anything else."""
        return int(name[:-5]) if name.endswith(".json") and NUMBER.fullmatch(name[:-5]) else None

    @staticmethod
    def part_number(name: str) -> int | None:
        """The part an ``NNNNN.json`` entry of a listing is for (an applied marker, an
        aggregator's claim or result); None for anything else."""
        return int(name[:-5]) if PART.fullmatch(name) else None

    def applied_part(self, s: int, key: str) -> int | None:
        """The part a listed key of state s's applied markers is for; None for anything else."""
        name = key.removeprefix(self.applied_dir(s) + "/")
        return self.part_number(name) if name != key else None

    @property
    def standing(self) -> str:
        """The volunteer aggregators' standing, as the scheduler keeps it across restarts: audits
        passed by each, who sits rounds out for withholding, until when every part is audited
        whole (organizer/referee.py)."""
        return f"{self.root}/aggregators.json"

    @property
    def flags_dir(self) -> str:
        return f"{self.root}/flags"

    def flag(self, volunteer: str) -> str:
        """Why a volunteer's shards are no longer admitted: its first shard the validator caught."""
        return f"{self.flags_dir}/{volunteer}.json"

    def stop(self) -> str:
        """Marker: the organizer ended the run; workers leave, schedulers commit what is closed and stop."""
        return f"{self.root}/STOP.json"

    @property
    def leases_dir(self) -> str:
        """The scheduler's lease, one create-once generation per holder (organizer/lease.py)."""
        return f"{self.root}/lease"

    def lease(self, generation: int) -> str:
        return f"{self.leases_dir}/{numbered(generation)}.json"

    def generation_of(self, key: str) -> int | None:
        """The generation a key listed under ``leases_dir`` is, or None (anything else)."""
        return self.number_of(key.rsplit("/", 1)[-1]) if key.startswith(self.leases_dir + "/") else None

    def report(self) -> str:
        """The run's static HTML page (`dedloc report --upload`): one key the organizer can publish."""
        return f"{self.root}/report/index.html"

    @property
    def evals_dir(self) -> str:
        return f"{self.root}/evals"

    def evals(self, s: int) -> str:
        """Every evaluation result of state s."""
        return f"{self.evals_dir}/{numbered(s)}"

    def eval(self, s: int, task: str) -> str:
        return f"{self.evals(s)}/{task}.json"

    def export(self, s: int) -> str:
        """State s as a Hugging Face model directory."""
        return f"{self.root}/export/{numbered(s)}"

    # what `dedloc repair` takes out of a run's history (organizer/repair.py)
    @property
    def quarantine_dir(self) -> str:
        """Damaged records and the states and rounds above the one a repair went back to: moved
        here, never deleted, for the organizer to inspect."""
        return f"{self.root}/damaged"

    def quarantine(self, stamp: str) -> str:
        """One repair's quarantine, named by when it ran (UTC, ``20270115T080000Z``)."""
        return f"{self.quarantine_dir}/{stamp}"

    def quarantined(self, stamp: str, key: str) -> str:
        """Where repair ``stamp`` keeps the run's object ``key``: the same path under its quarantine."""
        if not key.startswith(self.root + "/"):
            raise ValueError(f"{key!r} is not a key of run {self.run!r}")
        return f"{self.quarantine(stamp)}/{key.removeprefix(self.root + '/')}"

    @staticmethod
    def round_number(name: str) -> int | None:
        """The round an entry of the ``rounds_dir`` listing is, or None (debris)."""
        return int(name) if NUMBER.fullmatch(name) else None

    @staticmethod
    def holding(key: str) -> "RunLayout | None":
        """The layout of the run ``key`` belongs to (``runs/RUN/...``), or None."""
        parts = key.split("/", 2)
        return RunLayout(parts[1]) if len(parts) == 3 and parts[0] == "runs" else None

