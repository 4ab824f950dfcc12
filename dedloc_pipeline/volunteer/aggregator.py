"""A volunteer aggregator: it offers, and for the parts a CLOSE assigns it runs the round's
exchanges (``exchange.stages``, docs/aggregators.md) in one loop, as the scheduler does.

It reads the round view as a worker does (one GET a poll). It offers once a round, while the
round is open or already while the one before it is reduced. When the view shows a round closed,
it reads the CLOSE (one GET) and, for each exchange in turn, computes its value for each of its
parts and writes a claim (the value's digest); when the view says that exchange's reveal, it
writes each result (for the answers, the state's objects first); when the view says the
scheduler recorded the exchange, it reads the record (one GET) and goes on with the parts the
record leaves it. The values: the checks of its parts of the shards CLOSE admitted unread (the
shards read are kept for the reduction), with LAMB each part's partial sums (the gradient and
state kept for the step, which takes the norms the record holds), and the answer: state r+1
over the part. Everything it writes lies below its own prefix and is signed with its key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..checks import exchange
from ..checks.exchange import PARTS, SCREEN, SUMS, Stage
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
    seconds: float  # checking, reducing and stepping it
    revealed: bool = False


@dataclass
class Work:
    """One closed round's work: its exchanges, the one under way and the parts it has left, the
    values claimed and not yet revealed, and what one exchange keeps for the next."""

    close: Close
    stages: list[Stage]
    parts: list[int]
    at: int = 0  # the exchange under way
    claimed: dict[int, object] = field(default_factory=dict)  # part -> the value its claim commits to
    revealed: bool = False
    found: dict[int, dict] = field(default_factory=dict)  # part -> the shards' arrays read for its checks
    grads: dict[int, np.ndarray] = field(default_factory=dict)  # LAMB: part -> its mean gradient, to step
    states: dict[int, tuple] = field(default_factory=dict)  # LAMB: part -> state r over it, read once
    norms: dict | None = None  # LAMB: the norms the scheduler recorded
    answers: dict[int, dict[str, dict]] = field(default_factory=dict)  # part -> next_part's vectors

    @property
    def stage(self) -> Stage:
        return self.stages[self.at]


class AggregatorRole:
    """One volunteer's aggregator loop (``step``, ``serve``): ``peer`` signs with ``signer``,
    its volunteer's enrolled key, which the roster must let aggregate."""

    def __init__(self, run: Run, peer: str, signer: identity.Ed25519PrivateKey, clock: Clock | None = None):
        if (why := exchange.eligible(run)) is not None:
            raise RunError(f"run {run.name!r} takes no volunteer aggregators: {why}")
        self.run, self.peer, self.signer = run, peer, signer
        self.clock = run.clock if clock is None else clock
        self.offered: set[int] = set()
        self.closed: set[int] = set()  # rounds whose CLOSE was read
        self.work: dict[int, Work] = {}  # round -> its work, while it has parts left
        self.done: dict[tuple[int, int], Done] = {}
        self._value = {SCREEN: self._checks, SUMS: self._sums, PARTS: self._answer}

    def _write(self, key: str, record: dict) -> None:
        self.run.bucket.write_json(key, identity.sign_record(self.signer, {"run": self.run.name, **record}))

    def step(self) -> None:
        """One poll: offer for the open round, then take a closed one's exchanges as far as the
        view has gone."""
        v = view.read(self.run.bucket, self.run.keys, self.run.config.organizer_key)
        if v is None:  # no scheduler published yet: its first round may close at its first poll
            self._offer(self.run.latest())
            return
        if v.stopped or v.ended:
            return
        r = v.round
        self.work = {rr: w for rr, w in self.work.items() if rr >= r}
        self._offer(r + 1 if v.closed else r)  # while a round is reduced, already for the next: a short round
        if not v.closed:                        # may close before the next poll
            return
        if r not in self.closed:
            self.closed = {x for x in self.closed if x >= r - 1} | {r}
            close = Close.read(self.run, r)
            mine = [k for k, peers in enumerate(close.aggregators or []) if self.peer in peers] if close else []
            if mine:
                self.work[r] = Work(close, exchange.stages(close, self.run), mine)
                self._claim(self.work[r])
        if r in self.work:
            self._follow(self.work[r], v.reveal)

    def _follow(self, w: Work, reveal: str | None) -> None:
        """Round ``w``'s exchanges as far as the view's ``reveal`` has gone: the results of the
        one it reveals, then, past an exchange's record, the next exchange's claims."""
        while True:
            stage, r = w.stage, w.close.round
            if reveal == stage.reveal and not w.revealed:
                for k in sorted(w.claimed):
                    self._reveal(w, k)
                w.revealed = True
            if stage.record is None or not exchange.said(reveal, stage.recorded):
                return
            found = self.run.read_record(stage.record(self.run.keys, r), f"{stage.record.__name__} of round {r}",
                                         round=r)
            if found is None:  # the view is ahead of its listing: the next poll
                return
            w.norms = found.get("norms", w.norms)
            w.parts = [k for k in w.parts if k in found["parts"]]
            w.at, w.claimed, w.revealed = w.at + 1, {}, False
            self._claim(w)

    def _claim(self, w: Work) -> None:
        """Compute this exchange's value for each part left and commit to it: only its digest
        leaves this machine until the reveal."""
        stage, r = w.stage, w.close.round
        for k in w.parts:
            t0 = time.perf_counter()
            w.claimed[k] = self._value[stage](w, k)
            done = self.done.setdefault((r, k), Done(r, k, 0.0))
            done.seconds += time.perf_counter() - t0
            self._write(stage.claim(self.run.keys, r, self.peer, k), {
                "round": r, "peer": self.peer, "part": k, "digest": exchange.digest(self.peer, w.claimed[k])})
            log.info("round %d: %s of part %d computed and claimed", r, stage.noun, k)

    def _reveal(self, w: Work, k: int) -> None:
        stage, r, keys = w.stage, w.close.round, self.run.keys
        if stage is PARTS:  # the objects first: a result names them
            aggregation.write_part(self.run.bucket, keys.answer(r, self.peer, k), self.run, k, w.answers.pop(k))
            self.done[(r, k)].revealed = True
        self._write(stage.result(keys, r, self.peer, k), {"round": r, "peer": self.peer, "part": k,
                                                           stage.field: w.claimed[k]})
        log.info("round %d: %s of part %d revealed", r, stage.noun, k)

    def _offer(self, r: int) -> None:
        if r not in self.offered:
            self._write(self.run.keys.offer(r, self.peer), {"round": r, "peer": self.peer, "at": self.clock.time()})
            self.offered = {x for x in self.offered if x >= r - 1} | {r}

    # each exchange's value of a part
    def _checks(self, w: Work, k: int) -> list[float]:
        return self.check(w.close, k)

    def _sums(self, w: Work, k: int) -> dict[str, list[float]]:
        r = w.close.round
        w.grads[k] = self.gradient(r, k)
        w.states[k] = aggregation.read_state(self.run, r, k)  # its step needs it again
        return self.part_sums(r, k)

    def _answer(self, w: Work, k: int) -> dict[str, dict[str, list[str]]]:
        vectors = w.answers[k] = self.compute(w.close.round, k)
        formats, chunks = aggregation.next_formats(self.run), self.run.part_chunks(k)
        return {name: vector.chunk_checksums(formats[name], arrays, chunks) for name, arrays in vectors.items()}

    # the computations, by round and part (what a test's dishonest aggregator replaces)
    def check(self, close: Close, k: int) -> list[float]:
        """Part k of every shard CLOSE admitted, checked (``aggregation.part_checks``); the shards
        read are kept for the reduction."""
        arrays = aggregation.read_part(self.run, close.accepted, k)
        if (w := self.work.get(close.round)) is not None:
            w.found[k] = arrays
        return aggregation.part_checks(self.run, k, close.accepted, arrays)

    def gradient(self, r: int, k: int) -> np.ndarray:
        """Round r's mean gradient over part k (kept from the partial sums' claim, with LAMB; from
        the shards read for its checks, where it checked them)."""
        w = self.work.get(r)
        if w is not None and k in w.grads:
            return w.grads[k]
        return aggregation.mean_gradient(self.run, r, k, w.found.pop(k, None) if w is not None else None)

    def part_sums(self, r: int, k: int) -> dict[str, list[float]]:
        """LAMB: part k's partial sums of round r, which its trust ratios need whole."""
        w = self.work.get(r)
        return aggregation.part_sums(self.run, r, k, self.gradient(r, k), w.states.get(k) if w is not None else None)

    def compute(self, r: int, k: int) -> dict[str, dict]:
        """Part k of state r+1: round r's mean gradient over it, and the optimizer step (with
        LAMB, by the norms the scheduler recorded, on the state read for the partial sums, copied:
        a step writes into the arrays it is given)."""
        w = self.work.get(r)
        kept = w.states.get(k) if w is not None else None
        state = None if kept is None else (kept[0].copy(), {n: a.copy() for n, a in kept[1].items()},
                                           None if kept[2] is None else kept[2].copy())
        return aggregation.next_part(self.run, r, k, self.gradient(r, k), w.norms if w is not None else None, state)

    def serve(self, stop: Callable[[], bool], poll_s: float = 2.0) -> None:
        """Poll every ``poll_s`` until ``stop()``; a failing poll is logged and the next one tries
        again (the organizer computes what this aggregator does not settle)."""
        while not stop():
            try:
                self.step()
            except Exception as exc:
                log.warning("aggregator %s: %s", self.peer, exc)
            self.clock.sleep(poll_s)
