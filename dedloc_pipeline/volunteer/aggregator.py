"""A volunteer aggregator: it offers, computes the parts a CLOSE assigns it, claims, and reveals
(the protocol is ``exchange.py``'s; docs/aggregators.md).

It reads the round view as a worker does (one GET a poll). It offers once a round, while the
round is open or already while the one before it is reduced; when the view shows a round
closed, it reads the CLOSE (one GET), computes each part assigned to it from the frozen shards
and state r (the same code as the organizer's aggregators), and writes a claim per part; when
the view says reveal, it writes each answer's objects, then the result. Where CLOSE admitted
shards unread, it first checks its parts of them (kept for the reduction), claims the checks,
reveals them when the view says ``screen``, and once it says ``screened`` reads the scheduler's
record of them (one GET) and reduces the parts it is left. With LAMB it then claims each
part's partial sums, reveals them when the view says ``sums``, and once it says ``norms``
reads the norms the scheduler recorded (one GET), steps the parts it is left and claims their
answers. Everything it writes lies below its own prefix and is signed with its key. It keeps a
round's shards, gradients and answers in memory until they are used or revealed, or the round
is past.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..checks import exchange
from ..compute import aggregation
from ..protocol import view
from ..protocol.clock import Clock
from ..protocol.close import Close
from ..protocol.run import Run, RunError
from ..storage import vector
from ..trust import identity

log = logging.getLogger(__name__)


@dataclass
class Done:
    """What this aggregator did for one part: what a display shows and the leaderboard counts."""

    round: int
    part: int
    seconds: float  # reducing and stepping it
    revealed: bool = False


class AggregatorRole:
    """One volunteer's aggregator loop (``step``, ``serve``): ``peer`` signs with ``signer``,
    its volunteer's enrolled key, which the roster must let aggregate."""

    def __init__(self, run: Run, peer: str, signer: identity.Ed25519PrivateKey, clock: Clock | None = None):
        if (why := exchange.eligible(run)) is not None:
            raise RunError(f"run {run.name!r} takes no volunteer aggregators: {why}")
        self.run, self.peer, self.signer = run, peer, signer
        self.clock = run.clock if clock is None else clock
        self.lamb = run.config.aggregator_optimizer.name == "lamb"
        self.offered: set[int] = set()
        self.found: dict[tuple[int, int], dict] = {}  # (round, part) -> its shards' arrays, read for its check
        self.checks: dict[tuple[int, int], list[float]] = {}  # (round, part) -> its check, until revealed
        self._checking: dict[int, list[int]] = {}  # round -> its parts, checked, awaiting the scheduler's record
        self.grads: dict[tuple[int, int], np.ndarray] = {}  # LAMB: (round, part) -> its mean gradient, kept to step
        self.states: dict[tuple[int, int], tuple] = {}  # LAMB: (round, part) -> state r over it, read once
        self.sums: dict[tuple[int, int], dict] = {}  # LAMB: (round, part) -> its partial sums, until revealed
        self.norms: dict[int, dict] = {}  # LAMB: round -> the norms the scheduler recorded
        self.answers: dict[tuple[int, int], dict[str, dict]] = {}  # (round, part) -> next_part's vectors
        self.done: dict[tuple[int, int], Done] = {}
        self._closed: set[int] = set()  # rounds whose CLOSE was read and its parts claimed

    def _write(self, key: str, record: dict) -> None:
        self.run.bucket.write_json(key, identity.sign_record(self.signer, {"run": self.run.name, **record}))

    def step(self) -> None:
        """One poll: offer for the open round, claim the parts of a closed one, reveal them."""
        v = view.read(self.run.bucket, self.run.keys, self.run.config.organizer_key)
        if v is None:  # no scheduler published yet: its first round may close at its first poll
            self._offer(self.run.latest())
            return
        if v.stopped or v.ended:
            return
        r, keys = v.round, self.run.keys
        for kept in (self.found, self.checks, self.grads, self.states, self.sums, self.answers):
            for rk in [rk for rk in kept if rk[0] < r]:
                del kept[rk]
        self._offer(r + 1 if v.closed else r)  # while a round is reduced, already for the next: a short round
        if not v.closed:                        # may close before the next poll
            return
        if r not in self._closed:
            self._closed.add(r)
            close = Close.read(self.run, r)
            mine = [k for k, peers in enumerate(close.aggregators or []) if self.peer in peers] if close else []
            if mine and any(e.norm is None for e in close.accepted):  # shards admitted unread: checked first
                for k in mine:
                    self._claim_check(close, k)
                self._checking[r] = mine
            for k in [] if r in self._checking else mine:
                self._begin(r, k)
        if v.reveal == "screen":
            for (rr, k), checks in sorted(self.checks.items()):
                if rr == r:
                    self._write(keys.screen(r, self.peer, k), {"round": r, "peer": self.peer, "part": k,
                                                                "checks": checks})
                    log.info("round %d: check of part %d revealed", r, k)
            self.checks = {rk: x for rk, x in self.checks.items() if rk[0] != r}
        if r in self._checking and v.reveal in ("screened", "sums", "norms", "parts"):
            found = self.run.read_record(keys.screened(r), f"checks of round {r}'s shards", round=r)
            if found is None:  # the view is ahead of its listing: the next poll
                return
            for k in set(self._checking.pop(r)) & set(found["parts"]):
                self._begin(r, k)
        if v.reveal == "sums":
            for (rr, k), sums in sorted(self.sums.items()):
                if rr == r:
                    self._write(keys.sums(r, self.peer, k), {"round": r, "peer": self.peer, "part": k, "sums": sums})
                    log.info("round %d: partial sums of part %d revealed", r, k)
            self.sums = {rk: x for rk, x in self.sums.items() if rk[0] != r}
        if self.lamb and v.reveal in ("norms", "parts") and r not in self.norms and r in self._closed:
            found = self.run.read_record(keys.norms(r), f"norms of round {r}", round=r)
            if found is None:  # the view is ahead of its listing: the next poll
                return
            self.norms = {r: found["norms"]}
            for k in found["parts"]:
                if (r, k) in self.grads:
                    self._claim(r, k)
        if v.reveal == "parts":
            for (rr, k), vectors in sorted(self.answers.items()):
                if rr == r and not self.done[(r, k)].revealed:
                    aggregation.write_part(self.run.bucket, keys.answer(r, self.peer, k), self.run, k, vectors)
                    self._write(keys.result(r, self.peer, k), {"round": r, "peer": self.peer, "part": k,
                                                                "checksums": self._checksums(k, vectors)})
                    self.done[(r, k)].revealed = True
                    log.info("round %d: part %d revealed", r, k)

    def _offer(self, r: int) -> None:
        if r not in self.offered:
            self._write(self.run.keys.offer(r, self.peer), {"round": r, "peer": self.peer, "at": self.clock.time()})
            self.offered = {x for x in self.offered if x >= r - 1} | {r}

    def gradient(self, r: int, k: int) -> np.ndarray:
        """Round r's mean gradient over part k (kept from the partial sums' claim, with LAMB; from
        the shards read for its check, where it checked them)."""
        if (r, k) in self.grads:
            return self.grads[(r, k)]
        return aggregation.mean_gradient(self.run, r, k, self.found.pop((r, k), None))

    def check(self, close: Close, k: int) -> list[float]:
        """Part k of every shard CLOSE admitted, checked (``aggregation.part_checks``); the shards
        read are kept for the reduction."""
        found = self.found[(close.round, k)] = aggregation.read_part(self.run, close.accepted, k)
        return aggregation.part_checks(self.run, k, close.accepted, found)

    def _claim_check(self, close: Close, k: int) -> None:
        """Check part k of the shards of round ``close.round`` and commit to the checks."""
        r, t0 = close.round, time.perf_counter()
        self.checks[(r, k)] = self.check(close, k)
        self.done[(r, k)] = Done(r, k, time.perf_counter() - t0)
        self._write(self.run.keys.screen_claim(r, self.peer, k), {
            "round": r, "peer": self.peer, "part": k, "digest": exchange.digest(self.peer, self.checks[(r, k)])})
        log.info("round %d: part %d of the shards checked and claimed", r, k)

    def _begin(self, r: int, k: int) -> None:
        """Reduce part k of round r: with LAMB, claim its partial sums; else step and claim it."""
        (self._claim_sums if self.lamb else self._claim)(r, k)

    def part_sums(self, r: int, k: int) -> dict[str, list[float]]:
        """LAMB: part k's partial sums of round r, which its trust ratios need whole."""
        return aggregation.part_sums(self.run, r, k, self.gradient(r, k), self.states.get((r, k)))

    def compute(self, r: int, k: int) -> dict[str, dict]:
        """Part k of state r+1: round r's mean gradient over it, and the optimizer step (with
        LAMB, by the norms the scheduler recorded, on the state read for the partial sums)."""
        kept = self.states.get((r, k))
        state = None if kept is None else (kept[0].copy(), {n: a.copy() for n, a in kept[1].items()},
                                           None if kept[2] is None else kept[2].copy())
        return aggregation.next_part(self.run, r, k, self.gradient(r, k), self.norms.get(r), state)

    def _claim_sums(self, r: int, k: int) -> None:
        """LAMB: reduce part k of round r and commit to its partial sums; the gradient is kept."""
        t0 = time.perf_counter()
        self.grads[(r, k)] = self.gradient(r, k)
        self.states[(r, k)] = aggregation.read_state(self.run, r, k)  # its step needs it again
        self.sums[(r, k)] = self.part_sums(r, k)
        done = self.done.setdefault((r, k), Done(r, k, 0.0))
        done.seconds += time.perf_counter() - t0
        self._write(self.run.keys.sum_claim(r, self.peer, k), {
            "round": r, "peer": self.peer, "part": k, "digest": exchange.digest(self.peer, self.sums[(r, k)])})
        log.info("round %d: partial sums of part %d computed and claimed", r, k)

    def _claim(self, r: int, k: int) -> None:
        """Compute part k of round r and commit to it: only its digest leaves this machine."""
        t0 = time.perf_counter()
        vectors = self.compute(r, k)
        self.answers[(r, k)] = vectors
        done = self.done.setdefault((r, k), Done(r, k, 0.0))
        done.seconds += time.perf_counter() - t0
        self._write(self.run.keys.claim(r, self.peer, k), {
            "round": r, "peer": self.peer, "part": k,
            "digest": exchange.digest(self.peer, self._checksums(k, vectors))})
        log.info("round %d: part %d computed and claimed", r, k)

    def _checksums(self, k: int, vectors: dict[str, dict]) -> dict[str, dict[str, list[str]]]:
        formats, chunks = aggregation.next_formats(self.run), self.run.part_chunks(k)
        return {name: vector.chunk_checksums(formats[name], arrays, chunks) for name, arrays in vectors.items()}

    def serve(self, stop: Callable[[], bool], poll_s: float = 2.0) -> None:
        """Poll every ``poll_s`` until ``stop()``; a failing poll is logged and the next one tries
        again (the organizer computes what this aggregator does not settle)."""
        while not stop():
            try:
                self.step()
            except Exception as exc:
                log.warning("aggregator %s: %s", self.peer, exc)
            self.clock.sleep(poll_s)
