"""Repair of a run's committed history (`dedloc repair`): what is damaged, and the way back.

A run's truth is its COMMIT markers, and each COMMIT holds the checksums of its state's
parameters and delta (``ledger.commit``). One damaged record stops every role that reads it: a
truncated COMMIT.json, a parameter chunk whose bytes changed, a CLOSE written for a round whose
state is not intact, a LATEST naming no intact state. ``diagnose`` walks the states from the
newest down until one is intact: its COMMIT readable (and the organizer's, in a signed run), its
parameters matching the COMMIT's checksums, its optimizer state and streams record readable.
That state, or the newest checkpoint when every state kept whole is damaged, is where the run
goes on. Everything built above it cannot be trusted: the states above it, and the CLOSE,
reduction and verdicts of every round from its own on. ``apply`` moves those under the run's
quarantine (``runs/RUN/damaged/STAMP/``), never deleting them, and rewrites LATEST to it, so its
round is open again and closes anew from its shards. An intact state the run can go on from is
never moved, nor any volunteer's shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import ValidationError

from ..protocol.close import Close
from ..protocol.run import Run, RunError
from ..storage import vector
from ..storage.bucket import Damaged
from ..storage.layout import RunLayout
from ..storage.vector import VectorFormat
from ..trust import identity
from .lease import holder_of

# what a finding is about: a state's records, a round's, or the LATEST hint
Kind = Literal["COMMIT", "params", "delta", "optimizer", "streams", "pruned", "CLOSE", "marker", "stray", "LATEST"]
UNREADABLE = (Damaged, identity.IdentityError, ValidationError)  # a record that is not what it says
UNCOMMITTED = "not committed"  # a state folder without a COMMIT: a round in flight, or debris


@dataclass(frozen=True)
class Finding:
    """One thing wrong, named by its bucket key."""

    kind: Kind
    key: str
    problem: str


@dataclass(frozen=True)
class Plan:
    """What ``diagnose`` found and what ``apply`` does about it. ``state``: the newest intact state,
    where the run goes on (None: none is left). ``moved``: the keys taken to the quarantine;
    ``states`` and ``rounds``: the states above ``state`` and the rounds from its own on whose
    records are among them (empty when round ``state`` is not reopened); ``latest``: LATEST is
    rewritten to ``state``."""

    state: int | None
    findings: tuple[Finding, ...] = ()
    moved: tuple[str, ...] = ()
    states: tuple[int, ...] = ()
    rounds: tuple[int, ...] = ()
    latest: bool = False

    @property
    def healthy(self) -> bool:
        return self.state is not None and not self.findings

    @property
    def reopened(self) -> bool:
        """Round ``state`` is open again: what was built above it is moved."""
        return bool(self.states or self.rounds)

    @property
    def checkpoint(self) -> bool:
        """The run goes back past states whose parameters are pruned, to a checkpoint."""
        return any(f.kind == "pruned" for f in self.findings)


def _unreadable(exc: Exception) -> str:
    if isinstance(exc, Damaged):
        return f"not JSON ({exc.__cause__}): truncated or overwritten"
    if isinstance(exc, ValidationError):
        return f"not a valid record ({exc.error_count()} fields wrong)"
    return str(exc)


def _chunk_key(key: str, fmt: VectorFormat, i: int) -> str:
    """The object of chunk ``i`` of vector ``key`` (the vector and the chunk where it has several arrays)."""
    names = list(fmt.arrays())
    return f"{key}/{vector.chunk_object(fmt, names[0], i)}" if len(names) == 1 else f"{key} (chunk {i})"


def _bad_chunks(run: Run, key: str, fmt: VectorFormat, sums: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(chunk object, what is wrong) for each chunk of vector ``key`` that does not match ``sums``:
    one read of the whole vector, then chunk by chunk only once that fails."""
    if not isinstance(vector.read_vectors(run.bucket, [key], fmt, None, [sums])[0], vector.CorruptShard):
        return []
    bad = []
    for i in range(fmt.n_chunks):
        chunk = range(i, i + 1)
        try:
            got = vector.chunk_checksums(fmt, vector.read_vector(run.bucket, key, fmt, chunk, raw=True), chunk)
        except vector.CorruptShard as exc:
            bad.append((_chunk_key(key, fmt, i), f"unreadable ({exc})"))
            continue
        if any(got[name] != sums.get(name, [])[i:i + 1] for name in fmt.arrays()):
            bad.append((_chunk_key(key, fmt, i), "does not match its COMMIT's checksum"))
    return bad or [(key, "does not match its COMMIT's checksums")]


def _state_findings(run: Run, s: int) -> tuple[bool, dict | None, list[Finding]]:
    """Whether state s has a COMMIT object, the COMMIT if it reads as one, and what keeps the run
    from going on from it."""
    keys, fmt = run.keys, run.dense_format
    try:
        commit = run.read_record(keys.commit(s), f"COMMIT of state {s}", state=s)
    except UNREADABLE as exc:
        return True, None, [Finding("COMMIT", keys.commit(s), _unreadable(exc))]
    if commit is None:
        return False, None, []
    sums = commit.get("checksums") if isinstance(commit, dict) else None
    params = sums.get("params") if isinstance(sums, dict) else None
    if not isinstance(params, list) or len(params) != fmt.n_chunks:
        return True, None, [Finding("COMMIT", keys.commit(s), f"incomplete: no checksums of state {s}'s "
                                    f"{fmt.n_chunks} parameter chunks")]
    if commit.get("state") != s:
        return True, None, [Finding("COMMIT", keys.commit(s), f"the COMMIT of state {commit.get('state')!r}, "
                                    f"not of state {s}")]
    if not run.bucket.list(keys.params(s)):
        return True, commit, [Finding("pruned", keys.params(s), f"state {s} is committed, but its parameters are "
                                "pruned (not a checkpoint): the run cannot go on from it")]
    bad = _bad_chunks(run, keys.params(s), fmt, {"values": params})
    if bad:
        return True, commit, [Finding("params", key, problem) for key, problem in bad]
    for name in (*run.config.aggregator_optimizer.slots, "residual"):
        try:
            vector.read_vector(run.bucket, keys.optim(s, name), fmt, raw=True)
        except vector.CorruptShard as exc:
            return True, commit, [Finding("optimizer", keys.optim(s, name), f"unreadable ({exc})")]
    try:
        streams = run.read_record(keys.streams(s), f"streams of state {s}", state=s)
    except UNREADABLE as exc:
        return True, commit, [Finding("streams", keys.streams(s), _unreadable(exc))]
    if streams is not None and not (isinstance(streams, dict) and isinstance(streams.get("ends"), dict)):
        return True, commit, [Finding("streams", keys.streams(s), "holds no stream ends")]
    return True, commit, []


def _delta_findings(run: Run, s: int, commit: dict) -> list[Finding]:
    """State s's delta against its COMMIT: a bad one costs no state (peers then read the snapshot),
    so it is moved alone."""
    sums = commit["checksums"].get("delta")
    if not sums or not run.bucket.list(run.keys.delta(s)):  # state 0 has none; older states' are pruned
        return []
    return [Finding("delta", key, f"{problem}: peers read the snapshot instead")
            for key, problem in _bad_chunks(run, run.keys.delta(s), run.delta_format, sums)]


def _round_findings(run: Run, s: int, above: dict[int, str], rounds: list[int]) -> list[Finding]:
    """What is stray or damaged about the rounds from s on. While no state above s is committed,
    round s may be in flight (closed, reduced and applied in part: healthy); nothing may be closed,
    reduced or written on a state above s. ``above``: what each state above s is (damaged, pruned
    or not committed)."""
    keys, bucket, found = run.keys, run.bucket, []

    def what(t: int) -> str:
        return above.get(t, UNCOMMITTED)

    closed = bucket.exists(keys.close(s))
    if closed and _built_on(above):
        found.append(Finding("CLOSE", keys.close(s), f"round {s} made state {s + 1}, which is {what(s + 1)}: "
                             "it closes anew"))
    elif closed:
        try:
            Close.read(run, s)
        except UNREADABLE as exc:
            found.append(Finding("CLOSE", keys.close(s), _unreadable(exc)))
        else:  # in flight: its markers must read
            markers = [keys.reduced_marker(s, k) for k in range(run.n_parts)]
            markers += [keys.applied(s + 1, k) for k in range(run.n_parts)]
            for key, data in bucket.read_many(markers).items():
                if data is not None:
                    try:
                        bucket.parsed(key, data)
                    except Damaged as exc:
                        found.append(Finding("marker", key, _unreadable(exc)))
    elif bucket.find(keys.reduced_dir(s)):
        found.append(Finding("stray", keys.reduced_dir(s), f"round {s} is reduced, but has no CLOSE"))
    for t in sorted(t for t, state in above.items() if state == UNCOMMITTED):
        if t == s + 1 and not closed:
            found.append(Finding("stray", keys.state(t), f"state {t} is written, but round {s} has no CLOSE"))
        elif t > s + 1:
            found.append(Finding("stray", keys.state(t), f"state {t} is written on state {t - 1}, "
                                 f"which is {what(t - 1)}"))
    for r in (r for r in rounds if r > s):
        if bucket.exists(keys.close(r)):
            found.append(Finding("CLOSE", keys.close(r), f"round {r} is closed on state {r}, which is {what(r)}"))
        elif bucket.find(keys.reduced_dir(r)):
            found.append(Finding("stray", keys.reduced_dir(r), f"round {r} is reduced on state {r}, "
                                 f"which is {what(r)}"))
    return found


def _latest_finding(run: Run, s: int, above: dict[int, str]) -> Finding | None:
    """LATEST as a hint toward state s: readable, the organizer's, and walking up to s along the
    COMMITs, as ``Run.latest`` does once what is above s is gone."""
    key = run.keys.latest
    try:
        hint = run.read_record(key, "LATEST")
    except UNREADABLE as exc:
        return Finding("LATEST", key, _unreadable(exc))
    if hint is None:
        return Finding("LATEST", key, "missing")
    value = hint.get("state", hint.get("round")) if isinstance(hint, dict) else None
    if not isinstance(value, int) or value < 0:
        return Finding("LATEST", key, f"holds no state number ({hint!r})")
    if value > s:
        what = f"is {above[value]}" if value in above else "does not exist"
        return Finding("LATEST", key, f"points to state {value}, which {what}")
    gap = next((t for t in range(value + 1, s + 1) if not run.bucket.exists(run.keys.commit(t))), None)
    if gap is not None:
        return Finding("LATEST", key, f"points to state {value}, but state {gap} is not committed: "
                       f"the newest intact state is {s}")
    return None


def _built_on(above: dict[int, str]) -> bool:
    """A state above the intact one is committed: the run went on from what it cannot go on from."""
    return any(state != UNCOMMITTED for state in above.values())


def _numbers(names: list[str], parse: Callable[[str], int | None]) -> list[int]:
    return sorted(n for n in map(parse, names) if n is not None)


def diagnose(run: Run) -> Plan:
    """Check the states from the newest down to the newest intact one, and what lies above it;
    reads only, so it is the dry run."""
    keys, bucket = run.keys, run.bucket
    above: dict[int, str] = {}  # the states above the intact one, newest first, and what each is
    findings: list[Finding] = []
    s = commit = None
    for t in reversed(_numbers(bucket.list(keys.states), keys.state_number)):
        committed, commit, wrong = _state_findings(run, t)
        if commit is not None and not wrong:
            s = t
            break
        above[t] = UNCOMMITTED if not committed else "pruned" if wrong[0].kind == "pruned" else "damaged"
        findings += wrong
    if s is None:
        return Plan(None, tuple(findings))
    delta = _delta_findings(run, s, commit)
    rounds = [r for r in _numbers(bucket.list(keys.rounds_dir), keys.round_number) if r >= s]
    stray = _round_findings(run, s, above, rounds)
    latest = _latest_finding(run, s, above)
    findings += delta + stray + ([latest] if latest is not None else [])
    moved = [keys.delta(s)] if delta else []
    if not (_built_on(above) or stray):  # nothing built above s, or only a round in flight
        return Plan(s, tuple(findings), tuple(moved), latest=latest is not None)
    verdicts = _numbers(bucket.list(keys.verdicts_dir), keys.number_of)
    rounds = sorted({r for r in rounds + verdicts if r >= s}, reverse=True)
    records = [k for t in above for k in (keys.state(t), keys.evals(t), keys.export(t))]
    records += [k for r in rounds for k in (keys.close(r), keys.reduced_dir(r), keys.verdicts(r))]
    moved += [k for k in records if _objects(run, k)]
    return Plan(s, tuple(findings), tuple(moved), tuple(above), tuple(rounds), latest is not None)


def _objects(run: Run, key: str) -> list[str]:
    """The objects at ``key``: the one object, or everything below it."""
    return run.bucket.find(key) or ([key] if run.bucket.exists(key) else [])


def stamp(run: Run) -> str:
    """A repair's name: when it runs, UTC to the second."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(run.clock.time()))


def _unrepairable(run: Run) -> str:
    return (f"run {run.name!r}: no committed state is intact, not even a checkpoint: it cannot be repaired "
            "from what the bucket holds (restore a state from a copy of the bucket)")


def apply(run: Run, plan: Plan, name: str) -> None:
    """Do what ``plan`` says, moving to quarantine ``name`` (a ``stamp``). Every object is copied
    before anything is taken away, and the markers go last (CLOSEs, then COMMITs, then LATEST is
    rewritten), so a repair cut short leaves a run that still reads as damaged, and is repaired
    by running it again."""
    if plan.state is None:
        raise RunError(_unrepairable(run))
    keys, bucket = run.keys, run.bucket
    latest = run.record("LATEST", {"state": plan.state}) if plan.latest else None  # signed before anything moves
    for key in plan.moved:
        for obj in _objects(run, key):
            data = bucket.read_bytes(obj)
            if data is not None:
                bucket.write_bytes(keys.quarantined(name, obj), data)
    folders = [keys.state(t) for t in plan.states]
    closes = [keys.close(r) for r in plan.rounds]
    for key in plan.moved:
        if key not in folders + closes:
            bucket.delete(key)
    for t in plan.states:
        for part in (keys.params(t), keys.delta(t), keys.optim_dir(t), keys.applied_dir(t), keys.streams(t)):
            bucket.delete(part)
    for key in closes + folders:  # the markers last (and an empty folder a repair cut short left behind)
        bucket.delete(key)
    if latest is not None:
        bucket.write_json(keys.latest, latest)


def advice(key: str | None) -> str:
    """What a command adds to a damaged record's error: the way back, where `dedloc repair` sees it
    (a state's records, a round's, LATEST)."""
    keys = RunLayout.holding(key or "")
    if keys is None or not key.startswith((keys.states + "/", keys.rounds_dir + "/")):
        return ""
    return "; run `dedloc repair` to see and repair it"


def repair(run: Run, act: bool = False, say: Callable[[str], object] = print) -> bool:
    """`dedloc repair`: say what is wrong, a line each, and what would be done; with ``act``, do it.
    True when the run needs nothing more (it was healthy, or is repaired)."""
    plan = diagnose(run)
    if plan.healthy:
        older = run.commits()[1]  # what monitoring reads too: an older state's COMMIT
        for key, exc in sorted(older.items()):
            say(f"COMMIT: {key}: {_unreadable(exc)}; an older state's record, which nothing "
                "builds on and the bucket cannot rebuild: status, report and plot read around it; restore it "
                "from a copy of the bucket, or leave it")
        say(f"run {run.name}: state {plan.state} is intact, " + (
            "the run goes on from it" if older else "nothing to repair"))
        return True
    for f in plan.findings:
        say(f"{f.kind}: {f.key}: {f.problem}")
    holder = holder_of(run.bucket, run.keys, run.clock.time())
    if holder is not None:  # it would go on building on what the repair takes away
        busy = f"run {run.name} is scheduled by {holder}: stop that scheduler before repairing the run"
        if act:
            raise RunError(busy)
        say(f"note: {busy}")
    if plan.state is None:
        if act:
            raise RunError(_unrepairable(run))
        say(_unrepairable(run))
        return False
    s, name = plan.state, stamp(run)
    if act:
        apply(run, plan, name)
    for key in plan.moved:
        say(f"{'moved' if act else 'would move'} {key} to {run.keys.quarantined(name, key)}")
    if plan.latest:
        say(f"{'rewrote' if act else 'would rewrite'} {run.keys.latest}: state {s}")
    back = f"{'checkpoint ' if plan.checkpoint else ''}state {s}" + (f", round {s} open again" if plan.reopened else "")
    if not act:
        say(f"the run would go on from {back}: `dedloc repair --apply` does it")
        return False
    left = diagnose(run)
    for f in left.findings:
        say(f"still: {f.kind}: {f.key}: {f.problem}")
    if left.healthy:
        say(f"repaired: the run goes on from {back}"
            + ("; restart the workers that ran on a later state" if plan.states else ""))
    return left.healthy
