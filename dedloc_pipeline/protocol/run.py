"""One run in a bucket: its config, its committed states, and how the flat vector is cut."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import replace
from functools import cached_property

import numpy as np
from pydantic import ValidationError

from ..model.data import SYNTHETIC, DataError, card_hash, check_data, unigram_log_probs
from ..model.presets import seq_len_of
from ..storage import codec, vector
from ..storage.bucket import Bucket, Damaged
from ..storage.layout import LAYOUT_VERSION, DataLayout, RunLayout
from ..storage.vector import VectorFormat
from ..trust import identity
from .clock import REAL, Clock
from .config import RunConfig

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A run that cannot be used as asked (missing, incompatible, inconsistent)."""


ORGANIZER_KEY_ENV = "DEDLOC_ORGANIZER_KEY"  # where the organizer's processes find its private key
# rounds a volunteer's prefix holds at once: the one before the open round (its late shards fold
# into the open one), the open one and the next (peers computing ahead); older ones are pruned
LIVE_ROUNDS = 3


class Run:
    """``organizer``: the organizer's private key, on the organizer's machines (where not given,
    read from ``$DEDLOC_ORGANIZER_KEY`` when a record must be signed). In a run with an organizer
    key every record only the organizer writes (CLOSE, COMMIT, LATEST, streams) is signed with
    it and checked by every reader."""

    def __init__(self, bucket: Bucket, name: str, config: RunConfig | None = None,
                 organizer: identity.Ed25519PrivateKey | None = None, clock: Clock = REAL):
        self.bucket, self.keys, self.clock = bucket, RunLayout(name), clock
        self._committed = -1  # the newest state this reader saw a COMMIT of (one stays forever)
        self._unfounded: int | None = None  # a LATEST's state found to have no COMMIT
        if config is None:
            try:
                raw = bucket.read_json(self.keys.config)
            except ValueError as exc:
                raise RunError(f"run {name!r}: {exc}") from exc
            if raw is None:
                raise RunError(bucket.missing() or f"no run {name!r} in {bucket.url} (create it with `dedloc init`)")
            where = f"run {name!r}: {bucket.url}/{self.keys.config}"
            if not isinstance(raw, dict) or "layout_version" not in raw:
                raise RunError(f"{where} has no layout_version: not a dedloc run, or damaged")
            if raw["layout_version"] != LAYOUT_VERSION:
                raise RunError(f"run {name!r} uses bucket layout v{raw['layout_version']}; "
                               f"this dedloc reads v{LAYOUT_VERSION}: nothing was written")
            if raw.get("organizer_key") is not None:  # signed by the key it names (a pin says whose)
                identity.check_record(str(raw["organizer_key"]), raw, f"{where}")
            try:
                config = RunConfig.model_validate(_unsealed(raw))
            except ValidationError as exc:  # named as run.json's fields, not as the flags that set them
                fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise RunError(f"{where} is invalid: {fields}") from None
        self.config = config
        self.pruned_through: int | None = None  # the newest state this process pruned (ledger.prune)
        self.kept = vector.Kept()  # the reduced gradient and state this process wrote (compute/aggregation.py)
        self._organizer = organizer
        if organizer is not None and identity.public(organizer) != config.organizer_key:
            raise RunError(f"that private key is not the organizer key run {name!r} was created with")

    @property
    def signed(self) -> bool:
        return self.config.organizer_key is not None

    def organizer(self, what: str) -> identity.Ed25519PrivateKey:
        """The organizer's key, to sign ``what``; a clear error where this process has none."""
        if self._organizer is None:
            self._organizer = _organizer_from_env(self.config, what)
        return self._organizer

    def record(self, what: str, body: dict, **place) -> dict:
        """An organizer record as written: in a signed run, naming its run and its place (``place``:
        the round, state or volunteer its key is for) and signed, so that a genuine record copied
        to another key or run is refused where it lands (``read_record``)."""
        if not self.signed:
            return body
        return identity.sign_record(self.organizer(what), {**body, "run": self.name, **place})

    def read_record(self, key: str, what: str, **place) -> dict | None:
        """An organizer record (None if absent), in a signed run its signature checked and its run
        and ``place`` those of ``key``: a forged, edited or copied one raises IdentityError naming it."""
        found = self.bucket.read_json(key)
        if found is None or not self.signed:
            return found
        if not isinstance(found, dict):
            raise identity.IdentityError(f"{what} is not signed by the run's organizer: refused")
        return identity.check_place(identity.check_record(self.config.organizer_key, found, what), what,
                                    run=self.name, **place)

    def stop_record(self) -> dict | None:
        """STOP, if it stands (IdentityError if it is not the organizer's, in a signed run)."""
        return self.read_record(self.keys.stop(), "STOP")

    def stopped(self, delete_forged: bool = False) -> bool:
        """Whether the run is stopped. In a signed run only the organizer's STOP counts: anyone
        able to write STOP.json (every volunteer, on R2) could otherwise end the run; a forged one
        is logged and ignored, and with ``delete_forged`` (the scheduler, ``dedloc stop``) deleted."""
        if not self.signed:
            return self.bucket.exists(self.keys.stop())
        try:
            return self.stop_record() is not None
        except identity.IdentityError as exc:
            if not delete_forged:
                log.warning("%s: ignored", exc)
                return False
            log.error("%s: deleted", exc)
            self.bucket.delete(self.keys.stop())
            return False

    def stop(self, reason: str) -> bool:
        """Write STOP (signed in a signed run, a forged one replaced); False if it stood already."""
        if self.signed:
            self.stopped(delete_forged=True)
        return self.bucket.create_json(self.keys.stop(), self.record("STOP", {
            "reason": reason, "at": self.clock.time(), "state": self.latest()}))

    @property
    def per_volunteer(self) -> int:
        """The most keys one peer's prefix may hold for the scheduler to read it: its rounds
        still kept (``LIVE_ROUNDS``), each a heartbeat and twice ``max_parts`` shards with their
        manifests, and an aggregator's offer, and per part its claims and results of each exchange and its answer
        (``exchange.py``). A prefix holding more is not read at all, so a volunteer filling its
        own prefix slows no one's poll."""
        shard = len(vector.chunk_objects(self.grad_format)) + 1
        arrays = 2 + len(self.delta_format.stored()) + len(self.config.aggregator_optimizer.slots)  # + params, residual
        aggregating = 1 + 6 * self.n_parts + arrays * self.dense_format.n_chunks  # two records each exchange
        return LIVE_ROUNDS * (1 + 2 * self.config.close.max_parts * shard + aggregating)

    def written(self) -> tuple[dict[str, tuple[int, str | None]], frozenset[str]]:
        """What the volunteers wrote, in one listing of their prefixes (a LIST a 1000 keys), and
        the peers left out of it for holding more than ``per_volunteer`` keys."""
        bound = self.per_volunteer
        listed = self.bucket.listing(self.keys.volunteers_dir, per_folder=bound)
        over = frozenset(p for p, n in Counter(map(self.keys.writer, listed)).items() if n > bound)
        return {k: v for k, v in listed.items() if self.keys.writer(k) not in over}, over

    @property
    def name(self) -> str:
        return self.config.run

    @property
    def seq_len(self) -> int:
        return seq_len_of(self.config.preset, self.config.seq_len)

    def build_model(self):
        """The model (torch is loaded here: reading a run's state and ledger does not need it)."""
        from ..model.families import build_model
        return build_model(self.config.preset, self.config.seed, self.config.seq_len)

    @cached_property
    def flat(self):
        from ..model.flat import FlatLayout
        return FlatLayout(self.build_model())

    def _fmt(self, codec_name: str, whole: bool = False) -> VectorFormat:
        c = self.config
        return VectorFormat(codec_name, self.flat.n, c.chunk_size, c.block_size, whole)

    @cached_property
    def grad_format(self) -> VectorFormat:
        """A peer's shard: written whole, one object per array."""
        return self._fmt(self.config.codec, whole=True)

    @cached_property
    def dense_format(self) -> VectorFormat:
        """Parameters, optimizer state and reduced gradients: exact fp32."""
        return self._fmt("none")

    @cached_property
    def delta_format(self) -> VectorFormat:
        """What one writer makes and every peer downloads: worth lz4hc's slower, smaller frames."""
        return replace(self._fmt(self.config.param_codec), cname="lz4hc")

    @property
    def n_parts(self) -> int:
        return -(-self.dense_format.n_chunks // self.config.chunks_per_part)

    def part_chunks(self, part: int) -> range:
        k = self.config.chunks_per_part
        return range(part * k, min((part + 1) * k, self.dense_format.n_chunks))

    def part_bounds(self, part: int) -> tuple[int, int]:
        return self.dense_format.bounds("values", self.part_chunks(part))

    # committed states
    def latest_hint(self) -> int:
        """The state LATEST points to (-1 without one). A LATEST not signed by the organizer (in
        a signed run) is no hint: the newest state with a true COMMIT stands in (one listing; the
        next commit writes LATEST again). Buckets written before LATEST named its field ``state``
        stored it under ``round``: both are read."""
        try:
            hint = self.read_record(self.keys.latest, "LATEST")
        except identity.IdentityError as exc:
            log.error("run %s: %s; looking for the newest true COMMIT", self.name, exc)
            return self._newest_committed()
        if hint is None:
            return -1
        value = hint.get("state", hint.get("round"))
        if not isinstance(value, int) or value < 0:
            raise RunError(f"run {self.name!r}: LATEST.json holds no state number ({hint!r})")
        return value

    def _newest_committed(self) -> int:
        folders = sorted((n for n in map(self.keys.state_number, self.bucket.list(self.keys.states))
                          if n is not None), reverse=True)
        for s in folders:
            try:
                self.commit_of(s)
                return s
            except (RunError, identity.IdentityError):
                continue
        return -1

    def latest(self) -> int:
        """Newest committed state. LATEST is a hint; COMMIT markers are the truth: a LATEST
        naming a state with no COMMIT (damaged, or the newest state deleted) is read around, to
        the newest state with one (a HEAD the first time a hint names a state this reader has
        not seen committed)."""
        s = self.latest_hint()
        if s == self._unfounded:  # read around before: on from the newest state seen committed
            s = self._committed
        elif s > self._committed and not self.bucket.exists(self.keys.commit(s)):
            found = self._newest_committed()
            log.warning("run %s: LATEST names state %d, which has no COMMIT; state %d is the newest committed "
                        "(`dedloc repair --apply` rewrites LATEST)", self.name, s, found)
            self._unfounded, s = s, found
        if s < 0:
            raise RunError(f"run {self.name!r} has no committed state yet")
        self._committed = max(self._committed, s)
        while self.bucket.exists(self.keys.commit(s + 1)):
            if self.signed:  # a forged COMMIT is no state: the round loop stops at the last true one
                try:
                    self.commit_of(s + 1)
                except identity.IdentityError as exc:
                    log.error("run %s: %s", self.name, exc)
                    break
            s += 1
        self._committed = max(self._committed, s)
        return s

    def commits(self) -> tuple[dict[int, dict], dict[str, Damaged]]:
        """Every COMMIT, state 0 included, in one batch (concurrent on S3: long runs have
        thousands), as JSON and unchecked (what monitoring reads); and the ones that are not JSON,
        by key, as the ``Damaged`` each raised. Whoever reads them all reads around an older damaged one and
        names it; the newest state's is ``dedloc repair``'s to mend."""
        keys = self.keys
        states = sorted(s for s in map(keys.state_number, self.bucket.list(keys.states)) if s is not None)
        raw = self.bucket.read_many([keys.commit(s) for s in states])
        found, damaged = {}, {}
        for s in states:
            if raw.get(keys.commit(s)):
                try:
                    found[s] = self.bucket.parsed(keys.commit(s), raw[keys.commit(s)])
                except Damaged as exc:
                    damaged[keys.commit(s)] = exc
        return found, damaged

    def kept_states(self) -> list[int]:
        """The states whose parameters the run keeps (``ledger.prune``): state 0, every
        ``checkpoint_every``-th, and the last ``keep_states``; a learning curve needs no more."""
        latest, c = self.latest(), self.config
        return [s for s in range(latest + 1) if s % c.checkpoint_every == 0 or s > latest - c.keep_states]

    def stream_ends(self, s: int) -> dict[str, int]:
        """Where each peer's data stream is counted to as of state s (its streams record); a
        forged record counts as none (logged): streams then only move forward from here."""
        try:
            found = self.read_record(self.keys.streams(s), f"streams of state {s}", state=s)
        except identity.IdentityError as exc:
            log.error("run %s: %s; ignored", self.name, exc)
            return {}
        return dict(found["ends"]) if found else {}

    def commit_of(self, s: int) -> dict:
        c = self.read_record(self.keys.commit(s), f"COMMIT of state {s}", state=s)
        if c is None:
            raise RunError(f"state {s} of run {self.name!r} is not committed")
        self._committed = max(self._committed, s)
        return c

    def load_params(self, s: int, commit: dict | None = None) -> np.ndarray:
        """The full snapshot of state s, checked against its COMMIT."""
        commit = commit or self.commit_of(s)
        return vector.read_vector(self.bucket, self.keys.params(s), self.dense_format,
                                 checksums={"values": commit["checksums"]["params"]})

    def apply_delta(self, s: int, params: np.ndarray, commit: dict | None = None) -> np.ndarray:
        """State s from state s-1 and s's compressed delta; bit-identical to the snapshot."""
        commit = commit or self.commit_of(s)
        fmt = self.delta_format
        d = vector.read_vector(self.bucket, self.keys.delta(s), fmt, raw=True,
                              checksums=commit["checksums"]["delta"])
        new = codec.delta_apply(params, d, fmt.codec, fmt.block)
        sums = vector.chunk_checksums(self.dense_format, {"values": new}, range(self.dense_format.n_chunks))
        if sums["values"] != commit["checksums"]["params"]:
            raise vector.CorruptShard(f"state {s}: delta does not reproduce the committed parameters")
        return new


def _organizer_from_env(config: RunConfig, what: str) -> identity.Ed25519PrivateKey:
    """The organizer's private key from ``$DEDLOC_ORGANIZER_KEY``: a clear error if there is none,
    or if it is not the key ``config`` names."""
    path = os.environ.get(ORGANIZER_KEY_ENV)
    if not path:
        raise RunError(f"run {config.run!r} is signed: writing its {what} needs the organizer's private "
                       f"key (--organizer-key, or the path in ${ORGANIZER_KEY_ENV})")
    key = identity.load(path)
    if identity.public(key) != config.organizer_key:
        raise RunError(f"{path} is not the organizer key run {config.run!r} was created with")
    return key


def _unsealed(raw: dict) -> dict:
    """run.json's config fields: without the signature a signed run's carries."""
    return {k: v for k, v in raw.items() if k != "signature"} if isinstance(raw, dict) else raw


def init_run(bucket: Bucket, config: RunConfig, organizer: identity.Ed25519PrivateKey | None = None) -> Run:
    """Write run.json and commit state 0 (signed with ``organizer`` in a signed run). Re-running
    with the same config is a no-op."""
    keys = RunLayout(config.run)
    check_data(bucket, config.data, config.preset, seq_len_of(config.preset, config.seq_len))
    if config.data != SYNTHETIC:
        pinned = card_hash(bucket.read_bytes(DataLayout(config.data).card))
        if config.data_hash not in (None, pinned):
            raise DataError(f"data set {config.data!r} is not the one the config pins (its DATA.json changed)")
        config = config.model_copy(update={"data_hash": pinned})
    existing = bucket.read_json(keys.config)
    if existing is not None:
        if RunConfig.model_validate(_unsealed(existing)) != config:
            raise RunError(f"run {config.run!r} already exists in {bucket.url} with another config")
        run = Run(bucket, config.run, organizer=organizer)
        if bucket.exists(keys.commit(0)):
            return run
    else:
        body = config.model_dump(mode="json")
        if config.organizer_key is not None:  # signed, so a volunteer's pin (trust/pins.py) can be checked
            organizer = organizer or _organizer_from_env(config, "run.json")
            if identity.public(organizer) != config.organizer_key:
                raise RunError(f"that private key is not the organizer key run {config.run!r} names")
            body = identity.sign_record(organizer, body)
        bucket.create_json(keys.config, body)
        run = Run(bucket, config.run, organizer=organizer)
    p0 = run.flat.get()
    if config.unigram_bias and config.data != SYNTHETIC:
        bias = run.flat.tensor("predictions.bias")
        p0[bias.offset:bias.offset + bias.size] = unigram_log_probs(bucket, config.data, bias.size)
    # its optimizer state is zeros: no objects
    sums = vector.write_vector(bucket, keys.params(0), run.dense_format, {"values": p0})
    bucket.create_json(keys.commit(0), run.record("COMMIT of state 0", {
        "state": 0, "round": None, "step": 0, "samples": 0, "contributors": [], "loss": None,
        "checksums": {"params": sums["values"]}, "committed_at": run.clock.time(),
        "n_params": run.flat.n}, state=0))
    bucket.write_json(keys.latest, run.record("LATEST", {"state": 0}))
    log.info("initialised run %s in %s: %d parameters", config.run, bucket.url, run.flat.n)
    return run
