"""A volunteer's background transfers: its shards up and the next state down, on one thread.

One thread moves the bytes, so uploads go in order (the error feedback carries from one to the
next) and a state download runs between them, while the worker's thread computes on. Started on
the first transfer, ended when the worker leaves; a second Ctrl-C while leaving abandons the
upload under way before its manifest, so no half-counted shard lands.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..protocol import shard
from ..protocol.clock import Clock
from ..protocol.run import Run
from ..storage import part
from ..storage.codec import ErrorFeedback
from ..trust import identity


@dataclass(eq=False)
class Sent:
    """One upload of this peer's: ``at`` is when its manifest landed (inf while under way)."""

    round: int
    samples: int
    at: float = math.inf
    job: Future | None = None
    started: float = 0.0  # when it was handed to the transfer thread (the worker's clock)
    state_hash: str = ""  # the COMMIT of the state it was computed on (round ``round``'s)


class Transfers:
    """This peer's uploads (``sent``: the recent ones; ``sending``: those under way) and the
    state download under way (``fetching``: (state, its download))."""

    def __init__(self, run: Run, peer: str, clock: Clock, signer: identity.Ed25519PrivateKey | None,
                 mean: bool) -> None:
        """``mean``: a shard carries the mean gradient, its sum divided by the samples here
        (diloco's pseudo-gradient is sent as it is)."""
        self.run, self.peer, self.clock, self.signer, self.mean = run, peer, clock, signer, mean
        self.feedback = ErrorFeedback(run.config.codec, run.config.block_size)  # this thread's alone
        self.sent: deque[Sent] = deque(maxlen=64)
        self.sending: list[Sent] = []
        self.fetching: tuple[int, Future] | None = None
        self.upload_s = 0.0  # how long this peer's last upload took
        self._pool: ThreadPoolExecutor | None = None
        self._abandon = threading.Event()

    def submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{self.peer}-transfers")
        return self._pool.submit(fn, *args)

    def upload(self, update, r: int, samples: int, loss: float, data: shard.DataRef, stale: int,
               state_hash: str, **claims) -> Sent:
        """Send ``update`` (a copy: the caller's gradients go on) as a shard of round r;
        ``claims``: the manifest's other fields (diloco's inner steps and precision)."""
        sent = Sent(r, samples, started=self.clock.time(), state_hash=state_hash)
        self.sent.append(sent)
        sent.job = self.submit(self._send, update, r, samples, loss, data, stale, sent, claims)
        self.sending.append(sent)
        return sent

    def _send(self, update, r: int, samples: int, loss: float, data: shard.DataRef, stale: int, sent: Sent,
              claims: dict) -> str:
        """On the transfer thread: encode (the error feedback is this thread's alone, in
        upload order) and upload, chunks first and the manifest last."""
        if self.mean:
            update /= samples
        arrays = self.feedback.encode(update)
        key = shard.upload(self.run, r, self.peer, part.name(self.clock.time()), arrays, samples, loss, data,
                           stale_samples=stale, signer=self.signer, abandoned=self._abandon.is_set,
                           state_hash=sent.state_hash, **claims)
        sent.at = self.clock.time()
        return key

    def fetch(self, latest: int, load, *args) -> None:
        """Download state ``latest`` (``load(*args)``) unless a download is under way."""
        if self.fetching is None:
            self.fetching = (latest, self.submit(load, *args))

    def settled(self, sent: Sent, key: str | None) -> None:
        self.sending.remove(sent)
        self.upload_s = max(0.0, sent.at - sent.started) if key is not None else self.upload_s

    def fetched(self, wait: bool) -> tuple[int, Future] | None:
        """The state download, once done (waited for with ``wait``): taken out of ``fetching``."""
        if self.fetching is None or not (wait or self.fetching[1].done()):
            return None
        got, self.fetching = self.fetching, None
        return got

    def on_the_way(self, r: int) -> int:
        """Samples of round r under way: pending until their manifests land."""
        return sum(x.samples for x in self.sending if x.round == r)

    def landed(self, r: int) -> int:
        """Samples of round r whose manifests landed and were accounted for (``settled``)."""
        return sum(x.samples for x in self.sent if x.round == r and x.at < math.inf and x not in self.sending)

    def abandon(self) -> None:
        """The upload under way ends before its manifest (a second Ctrl-C while leaving)."""
        self._abandon.set()
        self.sending.clear()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=not self._abandon.is_set())
