"""The request model: what each step of a round sends to the bucket, counted as botocore sends it.

``Traffic`` reads a run's vector formats, parts and optimizer slots (``Run``, and
``RunConfig.aggregator_optimizer.slots``) and counts, per step, the requests by the price class
``IOStats`` counts them in (``Requests``): a shard's upload, a state's download, the scheduler's
polls, its closing, reduction, commit and pruning. ``tests/test_cost.py`` checks every count
against a real round on an S3 server.
"""

from __future__ import annotations

import json
import math
from dataclasses import astuple, dataclass, fields

from ..checks import draw
from ..protocol.run import LIVE_ROUNDS, Run
from ..protocol.shard import DataRef, Manifest
from ..storage.layout import LAYOUT_VERSION
from ..storage.vector import KEEP_BYTES, VectorFormat

CHECKSUM_JSON_BYTES = 38  # one chunk's 32-hex checksum in indented JSON (COMMIT, CLOSE)
SHARD_ENTRY_BYTES = 250  # a shard's entry in a COMMIT (key, peer, samples, loss, manifest hash)
PRUNE_WINDOW = 3  # ledger.prune's window: the states a process looks back at its first prune
S3_PAGE = 1000  # keys per LIST page and per DeleteObjects request


@dataclass(frozen=True)
class Requests:
    """Requests by the price class ``IOStats`` counts them in."""

    get: float = 0.0
    put: float = 0.0
    head: float = 0.0
    list: float = 0.0
    delete: float = 0.0

    def __add__(self, other: "Requests") -> "Requests":
        return Requests(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, k: float) -> "Requests":
        return Requests(*(a * k for a in astuple(self)))

    __rmul__ = __mul__

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}



def _chunks(fmt: VectorFormat) -> list[int]:
    """Chunks of each of a vector's stored arrays (one for a packed shard: ``VectorFormat.stored``)."""
    return [-(-length // clen) for _, length, clen in fmt.stored().values()]


def _objects(fmt: VectorFormat) -> int:
    """Objects a whole vector is stored as (its metadata is the run's): each array's chunks, or
    for a vector written whole (a shard) one object."""
    return sum(1 if fmt.whole else c for c in _chunks(fmt))


def _reads(fmt: VectorFormat, chunks: int | None = None) -> int:
    """GETs of a checksummed read (no metadata) of ``chunks`` chunks of each array (default
    all): a chunk each, or for a vector written whole one object, and for a range of it the
    shard's index and then the range's chunks."""
    arrays = len(fmt.stored())
    if chunks is None or chunks >= fmt.n_chunks:
        return arrays if fmt.whole else sum(_chunks(fmt))
    return arrays * (chunks + int(fmt.whole))


class Traffic:
    """What a run's steps move through the bucket: requests (R2 speaks S3's API through the same
    client, so one count serves both) and the sizes of the small records."""

    def __init__(self, run: Run):
        self.config = run.config
        self.n = run.flat.n
        self.grad, self.delta, self.dense = run.grad_format, run.delta_format, run.dense_format
        self.parts = [len(run.part_chunks(k)) for k in range(run.n_parts)]
        self.slots = len(run.config.aggregator_optimizer.slots)  # optimizer state vectors beside the params
        self.lossy_delta = run.config.param_codec != "none"  # the organizer's residual is written
        self.lamb = run.config.aggregator_optimizer.name == "lamb"
        # the reduced gradient and the state the organizer keeps of what it wrote (vector.Kept)
        self.kept = (2 + self.slots + int(self.lossy_delta)) * 4 * self.n <= KEEP_BYTES

    @property
    def chunks(self) -> int:
        return self.dense.n_chunks

    def manifest_bytes(self) -> int:
        """One shard's manifest as ``shard.upload`` writes it (a chunk checksum of each array)."""
        g = self.grad
        m = Manifest(layout_version=LAYOUT_VERSION, run="r" * 16, round=10**5, peer="p" * 16,
                     part="1" * 13 + "-abcdef", codec=g.codec, n=g.n, chunk_size=g.chunk_size, block=g.block,
                     samples=64, loss=1.0, data=DataRef(stream="p" * 16, ranges=[(10**6, 64)]),
                     checksums={name: ["0" * 32] * c for name, c in zip(g.arrays(), _chunks(g))},
                     state_hash="0" * 64, created_at=1.8e9)
        return len(json.dumps(m.model_dump(mode="json"), indent=1, sort_keys=True))

    def commit_bytes(self, shards: int) -> int:
        """A COMMIT, about: the checksums of the parameters and the delta, an entry per shard."""
        return 500 + CHECKSUM_JSON_BYTES * (self.chunks + sum(_chunks(self.delta))) + SHARD_ENTRY_BYTES * shards

    # requests, as botocore sends them to S3 (R2 speaks the same API through the same client)
    def shard_upload(self) -> Requests:
        """``shard.upload``: each array's one object of chunks, then the manifest; nothing read."""
        return Requests(put=_objects(self.grad) + 1)

    def state_download(self) -> Requests:
        """A synced peer moving one state on: the COMMIT, then each chunk of the delta (checksummed
        reads skip zarr's metadata)."""
        return Requests(get=1 + sum(_chunks(self.delta)))

    def volunteer_objects(self, shards: int, peers: int, rounds: int = LIVE_ROUNDS) -> int:
        """What the volunteers' prefixes hold over ``rounds`` rounds of ``shards`` shards (each its
        objects and manifest) and ``peers`` heartbeats: what the scheduler's listing shows."""
        return rounds * (shards * (_objects(self.grad) + 1) + peers)

    def scheduler_poll(self, heartbeats: int, manifests: int, first: bool = False, view: bool | None = None,
                       listed: int = 0) -> Requests:
        """One poll of the scheduler that does not close the round (``Scheduler.try_close``): the
        volunteers' prefixes listed (``listed`` objects: a LIST a 1000, empty or not; it shows the
        heartbeats, the manifests and the shards' objects of every round they keep), the given
        numbers of heartbeats and manifests read (those written since the last poll; with new
        manifests, the roster too in a signed run), STOP, and the view written if ``view``
        (default: when something was read, as the scheduler writes it only when it changed, and
        the keep-alive aside). The round's first poll also reads its CLOSE's absence (once a
        round: while the lease is held nobody else writes it) and what the round is judged
        against (``Judge.opening``): the COMMIT that opened it, the streams record, and the
        validator's flags (a listing)."""
        cfg = self.config
        view = bool(heartbeats or manifests or first) if view is None else view
        pages = max(1, math.ceil(listed / S3_PAGE))
        r = Requests(get=heartbeats + manifests + 3 * int(first), put=int(view), head=1, list=pages + int(first))
        r += Requests(get=int(cfg.organizer_key is not None and manifests > 0))  # the roster
        return r  # the previous round's CLOSE, which tells its late shards, is the one it wrote

    def closing(self, shards: int, unread: bool = False) -> Requests:
        """What closing adds to its poll: each new shard frozen (a server-side copy of each of its
        objects, billed as a PUT) and validated there (every chunk read and checksummed, unless
        ``unread``: volunteer aggregators check them after CLOSE; its objects' sizes came with
        the listing), the roster (signed runs) and the validator's
        flags read again, and CLOSE created and read back. In the local-steps mode the loss
        screen (``checks/probe.py``) reads the round's state once, its COMMIT and snapshot
        (the state before is still in memory from the previous round), plus the data blocks
        holding its drawn samples (none for the embedded data; a data set's blocks are cached,
        8 of them)."""
        cfg = self.config
        signed = int(cfg.organizer_key is not None)
        probe = 1 + _reads(self.dense) if cfg.algorithm == "diloco" and cfg.close.probe_samples else 0
        reads = 0 if unread else shards * _reads(self.grad)
        return (Requests(list=1, get=reads + signed + probe, put=shards * _objects(self.grad))
                + Requests(put=1, get=1))

    def lease_renewal(self) -> Requests:
        """The scheduler's lease renewed (``Lease.hold``, every ``RENEW`` of its time): the next
        generation's absence, then its own record rewritten."""
        return Requests(head=1, put=1)

    def finish(self, shards: int, first: bool = False) -> Requests:
        """``Scheduler.finish`` of a closed round: reduce and apply every part, commit (``prune``
        apart: ``prune_steady``); no array is made or opened (their metadata is the run's). The
        step takes the reduced gradient and the state from what this scheduler wrote (``kept``,
        ``vector.Kept``; the state not in a scheduler's ``first`` round): a GET of the marker that
        vouches for each instead of their chunks."""
        kept = self.kept and not first
        delta_arrays = len(self.delta.arrays())
        total = Requests()
        for c in self.parts:
            reduce = Requests(head=1, get=1 + shards * _reads(self.grad, c), put=c + 1)
            if self.lamb:  # partial norms need the range's params and state
                reduce += Requests(get=(1 + self.slots) * c)
            written = 1 + delta_arrays + self.slots + int(self.lossy_delta)
            apply = Requests(head=1, get=(1 if self.kept else c) + (1 if kept else (2 + self.slots) * c),
                             put=written * c + 1)
            if self.lamb:  # the norms recorded for volunteer aggregators (none here), then every part's sums
                apply += Requests(get=1 + len(self.parts))
            total += reduce + apply
        commit = Requests(get=5 + len(self.parts), put=3)
        return total + commit

    def audited(self, fraction: float | None = None) -> int:
        """Chunks an exchange's audits recompute in a round (``checks/audit.py``): every chunk
        (``fraction`` None: an aggregator not yet trusted, or after a lie), or ``fraction`` of each
        part's, one at least."""
        if fraction is None:
            return sum(self.parts)
        return sum(draw.count(c, fraction) for c in self.parts)

    def audits(self, shards: int, chunks: int, answers: int | None = None) -> Requests:
        """The organizer's audits of ``chunks`` chunks in each exchange of a settled round
        (``answers`` of them in the answers', if other): the
        checks of the shards (those chunks of each shard read), with LAMB the partial sums (the
        round's CLOSE and checks, the chunks of each shard, of the parameters and the optimizer
        slots), and the answers (the same reads, the residual too, the norms with LAMB once a
        part, and the answer's objects of those chunks, decoded), then the round's audit record and
        the aggregators' standing (their audits passed)."""
        grads = 2 + shards * _reads(self.grad, 1)  # CLOSE, the checks' record, each shard's chunk
        objects = 1 + len(self.delta.arrays()) + self.slots + int(self.lossy_delta)
        screened = self.config.algorithm != "diloco"
        before = Requests(get=shards * _reads(self.grad, 1)) * int(screened) + Requests(
            get=grads + 1 + self.slots) * int(self.lamb)
        answer = Requests(get=grads + 2 + self.slots + objects)
        return (before * chunks + answer * (chunks if answers is None else answers)
                + Requests(get=len(self.parts) * int(self.lamb), put=2))

    def checked_finish(self, polls: float) -> Requests:
        """``Scheduler.finish`` with volunteer aggregators settling every part
        (``checks/exchange.py``, a signed run): the roster, the sealed claims (none yet), the
        applied markers' listing, ``polls`` listings of the volunteers' prefixes while it waits,
        the claims sealed, the reveal (its listing, the organizer's STOP read, the view), per part
        two claims and two results read, each state object copied server-side (a CopyObject,
        billed as a PUT) and the applied marker; then the commit. (The offers are read at CLOSE:
        a GET each.) Before that, in the gradient mode, the exchange of the shards' checks, and
        with LAMB that of the partial sums: each as many polls, the same sealing, reveal and
        reads of two claims and two results a part, then its record written (signed: the checks,
        the norms; a sealed one read first) and the view saying so (its listing, STOP, the
        view); the commit reads the checks' record once more."""
        objects = 1 + len(self.delta.arrays()) + self.slots + int(self.lossy_delta)
        total = Requests(get=3, list=2 + polls, put=2)
        for c in self.parts:
            total += Requests(get=4, put=objects * c + 1)
        exchange = Requests(get=2 + 4 * len(self.parts), list=1 + polls, put=2) + Requests(get=2, list=1, put=2)
        screened = self.config.algorithm != "diloco"
        total += exchange * (int(screened) + int(self.lamb)) + Requests(get=int(screened))
        return total + Requests(get=5 + len(self.parts), put=3)

    def aggregating(self, shards: int, parts: float) -> Requests:
        """A volunteer aggregator's round, ``parts`` of the run's parts its share (the average
        part's chunks): its offer, CLOSE, per part CLOSE again (the reduction reads it), that
        range of every shard (a checksummed read) and of the state (parameters, optimizer slots,
        the residual), then its claim, its answer's objects and its result. In the gradient mode
        also the claim and the reveal of its check of the part of every shard (from the same
        reads of them, kept for the reduction), the checks recorded (a GET a round, and one a
        part as the reduction reads CLOSE); with LAMB the claim and the reveal of the part's
        partial sums (from the same reads of the state, kept for the step), and the norms recorded
        (a GET a round). Its view reads are its worker's (``estimate``)."""
        c = sum(self.parts) / len(self.parts)
        objects = 1 + len(self.delta.arrays()) + self.slots + int(self.lossy_delta)
        screened = int(self.config.algorithm != "diloco")
        per_part = Requests(get=1 + shards * _reads(self.grad, round(c)) + (2 + self.slots) * c,
                            put=objects * c + 2) + Requests(get=screened, put=2 * screened + 2 * int(self.lamb))
        return Requests(put=1, get=1 + screened + int(self.lamb)) + per_part * parts

    def between_rounds(self) -> Requests:
        """The round loop's own poll after a commit: LATEST, the next COMMIT's absence, CLOSE, STOP."""
        return Requests(get=2, head=2)

    def prune_state(self, shards: int, peers: int, checkpoint: bool = False) -> Requests:
        """``ledger.prune`` deleting one state that leaves the kept window and its round's
        scratch: a LIST page of each (the state's folder, the round's), and a DeleteObjects per
        1000 keys of what goes. A checkpoint keeps its params and optimizer state."""
        dense = self.dense
        state = len(self.parts) + _objects(self.delta) + 1  # applied, delta, streams
        if not checkpoint:
            state += _objects(dense) + (self.slots + 1) * dense.n_chunks  # params, optim
        kept = 1 + (0 if not checkpoint else _objects(dense) + (self.slots + 1) * dense.n_chunks)
        scratch = shards * _objects(self.grad) + _objects(dense) + len(self.parts)  # frozen, reduced
        r = Requests()
        for listed, doomed in ((state + kept, state), (scratch + 1, scratch)):  # the COMMIT, the CLOSE kept
            r += Requests(list=max(1, math.ceil(listed / S3_PAGE)), delete=math.ceil(doomed / S3_PAGE))
        return r

    def prune_volunteers(self, listed: int, doomed: int) -> Requests:
        """``ledger.prune`` at every commit, in the volunteers' prefixes: a LIST page per 1000 of
        the ``listed`` objects there, and a DeleteObjects per 1000 of the ``doomed`` (the round
        that left ``LIVE_ROUNDS``, and any key off the layout)."""
        return Requests(list=max(1, math.ceil(listed / S3_PAGE)), delete=math.ceil(doomed / S3_PAGE))

    def prune_missing(self) -> Requests:
        """``ledger.prune`` deleting a state that is gone already (the ``PRUNE_WINDOW`` a
        process looks back once): a LIST each of the state and its round."""
        return Requests(list=2)

    def prune_steady(self, shards: int, peers: int) -> Requests:
        """``ledger.prune`` after one commit in a long run, on average: one state leaves the
        kept window (a process deletes each state once), and one round the volunteers' prefixes."""
        k = 1 / self.config.checkpoint_every
        doomed = self.volunteer_objects(shards, peers, 1)
        return (self.prune_state(shards, peers) * (1 - k) + self.prune_state(shards, peers, True) * k
                + self.prune_volunteers(self.volunteer_objects(shards, peers), doomed))
