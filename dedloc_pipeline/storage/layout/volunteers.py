"""Keys below ``runs/RUN/volunteers/{peer}/``: everything a volunteer writes, under one prefix each,
so a plain-prefix credential (R2's) confines a volunteer as a wildcard policy does (policy.py); and
the parser of what a listing of them shows, which no key that is off the layout passes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .names import EXCHANGES, NUMBER, PART, STATE_CHUNK, is_name, numbered


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


class VolunteerKeys:
    """The keys a volunteer writes, for ``RunLayout`` (which gives ``root`` and ``shard_parts``' round)."""

    root: str
    run: str

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
        return f"{self.volunteer_dir(peer)}/{numbered(r)}"

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
        m = STATE_CHUNK.fullmatch(path)
        return (path, int(m.group(1))) if path != key and m else None

    def written(self, key: str) -> Written | None:
        """What a key under ``volunteers_dir`` is (``Written``), or None: off the layout, which no
        reader takes (a volunteer can write anything under its own prefix)."""
        rest = key.removeprefix(self.volunteers_dir + "/")
        if rest == key:
            return None
        parts = rest.split("/")
        if len(parts) < 3 or not is_name(parts[0]) or not NUMBER.fullmatch(parts[1]):
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
        if len(what) == 2 and what[0] in ("claims", "results") and PART.fullmatch(what[1]):
            return Written(peer, r, what[0][:-1], what[1][:-5])
        if len(what) == 3 and what[0] in EXCHANGES and what[1] in ("claims", "results") and PART.fullmatch(what[2]):
            return Written(peer, r, EXCHANGES[what[0]][what[1] == "results"], what[2][:-5])
        if len(what) >= 3 and what[0] == "parts" and PART.fullmatch(what[1] + ".json"):
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
        if rest == key or not NUMBER.fullmatch(head):
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

