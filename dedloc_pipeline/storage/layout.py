"""Bucket keys of one run. Every key the project writes is spelled here, and every key it reads
back from a listing is parsed here, so the layout can change in one place.

Numbering: state ``s`` is what the parameters are after ``s`` optimizer steps; round ``r`` is the
batch of gradients computed against state ``r``, and committing it makes state ``r + 1``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

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


_NUMBER = re.compile(r"\d{8}")
_PART = re.compile(r"\d{5}\.json")  # an aggregator part's record
_EXCHANGES = {"screens": ("screen_claim", "screen"), "sums": ("sum_claim", "sums")}  # folder: its kinds
_STATE_CHUNK = re.compile(r"(?:params|delta|optim/[^/]+)/[^/]+/c/(\d+)")  # a state vector's chunk object


def _n(i: int) -> str:
    return f"{i:08d}"


class Written(NamedTuple):
    """A key a volunteer writes, parsed: whose, which round, and what (``progress``: its
    heartbeat; ``manifest``; ``shard``: a shard's folder; ``object``: one of its objects, ``path``
    below the folder; an aggregator's ``offer``, and per part its ``claim``, ``result`` and
    ``answer`` objects, its ``screen_claim`` and ``screen``, and with LAMB its ``sum_claim`` and ``sums``)."""

    peer: str
    round: int
    kind: str
    part: str = ""
    path: str = ""


class RunLayout:
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
        return f"{self.rosters}/{_n(version)}.json"

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
        return int(name) if _NUMBER.fullmatch(name) else None

    # state s: what round s's gradients are computed against
    def state(self, s: int) -> str:
        return f"{self.root}/state/{_n(s)}"

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
        return f"{self.rounds_dir}/{_n(r)}"

    # what volunteers write: everything under one prefix each, ``volunteers/{peer}/``, so a
    # plain-prefix credential (R2's) confines a volunteer as a wildcard policy does (policy.py)
    @property
    def volunteers_dir(self) -> str:
        return f"{self.root}/volunteers"

    def volunteer_dir(self, peer: str) -> str:
        """The one prefix peer ``peer`` writes: its heartbeats, shards and manifests, by round."""
        return f"{self.volunteers_dir}/{peer}"

    def writer(self, key: str) -> str:
        """The folder just below ``volunteers_dir`` that ``key`` lies in: whose prefix it is."""
        return key.removeprefix(self.volunteers_dir + "/").split("/", 1)[0]

    def _own(self, peer: str, r: int) -> str:
        return f"{self.volunteer_dir(peer)}/{_n(r)}"

    def progress(self, r: int, peer: str) -> str:
        """A peer's heartbeat of round r: ``volunteers/PEER/R/progress.json``."""
        return f"{self._own(peer, r)}/progress.json"

    def shard(self, r: int, peer: str, part: str) -> str:
        """A shard's folder: ``volunteers/PEER/R/shards/PART``, its objects below it."""
        return f"{self._own(peer, r)}/shards/{part}"

    def manifests_dir(self, r: int, peer: str) -> str:
        """A peer's manifests of round r, apart from the chunks."""
        return f"{self._own(peer, r)}/manifests"

    def manifest(self, shard: str) -> str:
        """Marker of a shard, written after its chunks: ``volunteers/PEER/R/manifests/PART.json``."""
        r, peer, part = self.shard_parts(shard)
        return f"{self.manifests_dir(r, peer)}/{part}.json"

    # a volunteer aggregator's, round r (checks/exchange.py)
    def offer(self, r: int, peer: str) -> str:
        """An aggregator's offer to aggregate parts of round r: ``volunteers/PEER/R/offer.json``."""
        return f"{self._own(peer, r)}/offer.json"

    def claim(self, r: int, peer: str, part: int) -> str:
        """An aggregator's commitment to its answer for a part, before anyone's is shown."""
        return f"{self._own(peer, r)}/claims/{part:05d}.json"

    def answer(self, r: int, peer: str, part: int) -> str:
        """An aggregator's answer for a part, once revealed: state r+1's vectors over its chunks,
        at the same paths below here as below ``state(r + 1)``."""
        return f"{self._own(peer, r)}/parts/{part:05d}"

    def result(self, r: int, peer: str, part: int) -> str:
        """An aggregator's record of its revealed answer (its checksums), written after it."""
        return f"{self._own(peer, r)}/results/{part:05d}.json"

    def screen_claim(self, r: int, peer: str, part: int) -> str:
        """An aggregator's commitment to its check of a part of every shard of round r (checks/exchange.py)."""
        return f"{self._own(peer, r)}/screens/claims/{part:05d}.json"

    def screen(self, r: int, peer: str, part: int) -> str:
        """An aggregator's revealed check of a part of every shard: each one's sum of squares there."""
        return f"{self._own(peer, r)}/screens/results/{part:05d}.json"

    def sum_claim(self, r: int, peer: str, part: int) -> str:
        """LAMB: an aggregator's commitment to a part's partial sums, before anyone's is shown."""
        return f"{self._own(peer, r)}/sums/claims/{part:05d}.json"

    def sums(self, r: int, peer: str, part: int) -> str:
        """LAMB: an aggregator's revealed partial sums of a part (what its trust ratios need)."""
        return f"{self._own(peer, r)}/sums/results/{part:05d}.json"

    def answer_object(self, r: int, peer: str, part: int, path: str) -> str:
        """Object ``path`` of an aggregator's answer (``state_path``: as below a state)."""
        return f"{self.answer(r, peer, part)}/{path}"

    def state_object(self, s: int, path: str) -> str:
        """Object ``path`` of state s (``state_path``)."""
        return f"{self.state(s)}/{path}"

    @staticmethod
    def state_path(base: str, key: str) -> tuple[str, int] | None:
        """Where ``key`` lies below ``base`` (a state's folder, or an aggregator's answer, which
        keep the same paths), and the chunk it holds, if it is a chunk object of a state's
        vector (``params``, ``delta``, ``optim/NAME``, then the array's ``c/N``); else None."""
        path = key.removeprefix(base + "/")
        m = _STATE_CHUNK.fullmatch(path)
        return (path, int(m.group(1))) if path != key and m else None

    def written(self, key: str) -> Written | None:
        """What a key under ``volunteers_dir`` is (``Written``), or None: off the layout, which no
        reader takes (a volunteer can write anything under its own prefix)."""
        rest = key.removeprefix(self.volunteers_dir + "/")
        if rest == key:
            return None
        parts = rest.split("/")
        if len(parts) < 3 or not is_name(parts[0]) or not _NUMBER.fullmatch(parts[1]):
            return None
        peer, r, what = parts[0], int(parts[1]), parts[2:]
        if what == ["progress.json"]:
            return Written(peer, r, "progress")
        if len(what) == 2 and what[0] == "manifests" and what[1].endswith(".json") and is_name(what[1][:-5]):
            return Written(peer, r, "manifest", what[1][:-5])
        if len(what) >= 2 and what[0] == "shards" and is_name(what[1]):
            return Written(peer, r, "shard" if len(what) == 2 else "object", what[1], "/".join(what[2:]))
        if what == ["offer.json"]:
            return Written(peer, r, "offer")
        if len(what) == 2 and what[0] in ("claims", "results") and _PART.fullmatch(what[1]):
            return Written(peer, r, what[0][:-1], what[1][:-5])
        if len(what) == 3 and what[0] in _EXCHANGES and what[1] in ("claims", "results") and _PART.fullmatch(what[2]):
            return Written(peer, r, _EXCHANGES[what[0]][what[1] == "results"], what[2][:-5])
        if len(what) >= 3 and what[0] == "parts" and _PART.fullmatch(what[1] + ".json"):
            return Written(peer, r, "answer", what[1], "/".join(what[2:]))
        return None

    def _written(self, key: str, kind: str) -> Written:
        w = self.written(key)
        if w is None or w.kind != kind:
            raise ValueError(f"{key!r} is not a {kind} key of run {self.run!r}")
        return w

    def of_round(self, listed: Iterable[str], r: int, kind: str) -> list[str]:
        """The keys among ``listed`` that are round r's heartbeats, manifests or shard objects
        (``kind``: ``progress``, ``manifest``, ``object``), sorted."""
        return sorted(k for k in listed if (w := self.written(k)) is not None and w.round == r and w.kind == kind)

    def round_of(self, key: str) -> int:
        """The round of a volunteer's key (a heartbeat, a manifest, a shard) or of a key under ``rounds/``."""
        w = self.written(key)
        if w is not None:
            return w.round
        rest = key.removeprefix(f"{self.rounds_dir}/")
        head = rest.split("/", 1)[0]
        if rest == key or not _NUMBER.fullmatch(head):
            raise ValueError(f"{key!r} is not a key of a round of run {self.run!r}")
        return int(head)

    def peer_of_progress(self, key: str) -> str:
        """Whose heartbeat a key is: the prefix it lies under, which only that peer may write."""
        return self._written(key, "progress").peer

    def shard_holding(self, key: str) -> str | None:
        """The shard key a listed shard object belongs to; None for any other key."""
        w = self.written(key)
        return self.shard(w.round, w.peer, w.part) if w is not None and w.kind == "object" else None

    def shard_parts(self, shard: str) -> tuple[int, str, str]:
        """(round, peer, part) of a shard key ``volunteers/PEER/R/shards/PART``."""
        w = self._written(shard, "shard")
        return w.round, w.peer, w.part

    def shard_of(self, manifest: str) -> str:
        w = self._written(manifest, "manifest")
        return self.shard(w.round, w.peer, w.part)

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
        return f"{self.verdicts_dir}/{_n(r)}.json"

    @staticmethod
    def number_of(name: str) -> int | None:
        """The number an ``NNNNNNNN.json`` entry of a listing stands for (a roster version, a
        verified round); None for anything else."""
        return int(name[:-5]) if name.endswith(".json") and _NUMBER.fullmatch(name[:-5]) else None

    @staticmethod
    def part_number(name: str) -> int | None:
        """The part an ``NNNNN.json`` entry of a listing is for (an applied marker, an
        aggregator's claim or result); None for anything else."""
        return int(name[:-5]) if _PART.fullmatch(name) else None

    def applied_part(self, s: int, key: str) -> int | None:
        """The part a listed key of state s's applied markers is for; None for anything else."""
        name = key.removeprefix(self.applied_dir(s) + "/")
        return self.part_number(name) if name != key else None

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
        return f"{self.leases_dir}/{_n(generation)}.json"

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
        return f"{self.evals_dir}/{_n(s)}"

    def eval(self, s: int, task: str) -> str:
        return f"{self.evals(s)}/{task}.json"

    def export(self, s: int) -> str:
        """State s as a Hugging Face model directory."""
        return f"{self.root}/export/{_n(s)}"

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
        return int(name) if _NUMBER.fullmatch(name) else None

    @staticmethod
    def holding(key: str) -> "RunLayout | None":
        """The layout of the run ``key`` belongs to (``runs/RUN/...``), or None."""
        parts = key.split("/", 2)
        return RunLayout(parts[1]) if len(parts) == 3 and parts[0] == "runs" else None


class DataLayout:
    """Keys under ``data/{name}/``: a tokenized data set, shared by every run that names it."""

    ROOT = "data"  # every data set's folder: what a volunteer may read besides its run

    def __init__(self, name: str):
        self.root = f"{self.ROOT}/{name}"

    @property
    def card(self) -> str:
        """Written last: a data set exists once its card does."""
        return f"{self.root}/DATA.json"

    @property
    def tokenizer(self) -> str:
        return f"{self.root}/tokenizer"

    def shard(self, split: str, i: int) -> str:
        return f"{self.root}/{split}/{i:05d}.npz"

    @property
    def unigram(self) -> str:
        """Token counts of the training split."""
        return f"{self.root}/unigram.npz"
