"""Volunteer aggregators (issue 27, docs/aggregators.md): two to a part, committed only when they
agree bit for bit; the organizer computes what they do not settle and flags the one that lied.

Real lock-step workers of the micro model fill the rounds of a signed run; aggregators x and y
(enrolled, the roster letting them aggregate) answer on a DrivenClock, so they act while the
scheduler waits for them. Each case checks every committed state against the organizer's own
answer for its round, recomputed here from its CLOSE.
"""

from __future__ import annotations

import io
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from rich.console import Console

from dedloc_pipeline.checks import exchange, flags
from dedloc_pipeline.compute import aggregation, optim
from dedloc_pipeline.monitoring.display import Display
from dedloc_pipeline.monitoring.status import status
from dedloc_pipeline.organizer import referee
from dedloc_pipeline.protocol.close import Close
from dedloc_pipeline.protocol.run import Run, RunError, init_run
from dedloc_pipeline.storage import vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import DrivenClock, LockStep, on_clock, run_processes, small_config
from dedloc_pipeline.trust import identity
from dedloc_pipeline.volunteer.aggregator import AggregatorRole

ROUNDS = 2


def _run(tmp_path, bucket, aggregate_s: float = 60.0, close: dict | None = None, **kw):
    """A signed run (micro, a part per chunk unless ``chunks_per_part`` says) with a, b computing
    and x, y, z enrolled, x and y as aggregators; its keys by name."""
    org = identity.generate(tmp_path / "org.pem")
    keys = {n: identity.generate(tmp_path / f"{n}.pem") for n in ("a", "b", "x", "y", "z")}
    cfg = small_config(organizer_key=identity.public(org), codec="int8",
                       close={"aggregate_s": aggregate_s, **(close or {})}, **{"chunks_per_part": 1, **kw})
    run = init_run(bucket, cfg, organizer=org)
    identity.update_roster(bucket, run.name, org, enroll={n: identity.public(k) for n, k in keys.items()},
                           aggregate=["x", "y"])
    return on_clock(run, DrivenClock(epoch=run.commit_of(0)["committed_at"])), keys


def _organizers(run, r: int) -> dict[str, list[str]]:
    """State r+1's params and delta checksums as the organizer's own reduction and step give them."""
    sums: dict[str, list] = {"params": [], "delta": {}}
    formats = aggregation.next_formats(run)
    grads = [aggregation.mean_gradient(run, r, k) for k in range(run.n_parts)]
    norms = None
    if run.config.aggregator_optimizer.name == "lamb":  # every part's partial sums, merged in part order
        norms = optim.merge_partials([s for k, g in enumerate(grads) for s in aggregation.part_sums(run, r, k, g)])
    for k in range(run.n_parts):
        vectors = aggregation.next_part(run, r, k, grads[k], norms)
        sums["params"] += vector.chunk_checksums(formats["params"], vectors["params"], run.part_chunks(k))["values"]
        for name, s in vector.chunk_checksums(formats["delta"], vectors["delta"], run.part_chunks(k)).items():
            sums["delta"].setdefault(name, []).extend(s)
    return sums


def _collaborate(run, keys, tamper=None, volunteers=True):
    """a and b compute, x and y aggregate (``tamper``: what x does instead of its honest part)
    until state ROUNDS; each state checked against the organizer's own answer. The COMMITs, the
    aggregators' roles and the workers."""
    with LockStep(run, volunteers=volunteers) as c:
        for n, mb in (("a", 4), ("b", 3)):
            c.join(n, mb, signer=keys[n])
        roles = {n: c.aggregate(n, keys[n]) for n in ("x", "y")}
        if tamper is not None:
            tamper(roles)
        states = []
        for r in range(ROUNDS):
            c.until(lambda: run.latest() > r, 400, f"state {r + 1}")
            commit = run.commit_of(r + 1)
            assert commit["checksums"] == _organizers(run, r), f"state {r + 1} is not the organizer's answer"
            states.append(commit)
    return states, roles, c.workers


def test_two_honest_aggregators_commit_what_the_organizers_reduction_gives(tmp_path, bucket):
    run, keys = _run(tmp_path, bucket)
    assert run.n_parts >= 3
    states, roles, workers = _collaborate(run, keys)
    for r, commit in enumerate(states):
        close = Close.read(run, r)
        assert close.aggregators and all(sorted(p) == ["x", "y"] for p in close.aggregators)
        assert commit["aggregated_by"] == close.aggregators
    assert all(d.revealed for role in roles.values() for d in role.done.values())
    assert len(roles["x"].done) == ROUNDS * run.n_parts
    assert flags.read(run) == {}
    credited = {p["peer_id"]: p["aggregated"] for p in status(run)["peers"]}  # the leaderboard's column
    assert credited["x"] == credited["y"] == ROUNDS * run.n_parts and credited["a"] == 0
    panel = Display(workers["a"], plain=True, console=Console(file=io.StringIO()), role=roles["x"])
    n = ROUNDS * run.n_parts  # what a volunteer serving both roles sees of the second
    assert panel.line(panel.facts()).endswith(f"| aggregator: {n} parts computed, {n} revealed, last in round 1")


LAMB = {"optimizer": {"name": "lamb", "lr": 5e-3}}


def test_lamb_two_honest_aggregators_agree_on_the_sums_then_on_the_steps(tmp_path, bucket):
    """LAMB (sahajBERT's recipe): x and y agree on every part's partial sums, the scheduler
    records their merged norms, and both step every part by them: every state is the
    organizer's own answer (its own sums merged), every part theirs."""
    run, keys = _run(tmp_path, bucket, **LAMB)
    states, roles, _ = _collaborate(run, keys)
    for r, commit in enumerate(states):
        norms = run.read_record(run.keys.norms(r), "norms", round=r)
        assert norms["parts"] == list(range(run.n_parts))
        assert commit["aggregated_by"] == Close.read(run, r).aggregators
    assert all(d.revealed for role in roles.values() for d in role.done.values())
    assert flags.read(run) == {}


def test_control_without_volunteer_aggregators_the_organizer_computes_every_part(tmp_path, bucket):
    run, keys = _run(tmp_path, bucket)
    states, roles, _ = _collaborate(run, keys, volunteers=False)
    assert all(c["aggregated_by"] == [["organizer"]] * run.n_parts for c in states)
    assert all(Close.read(run, r).aggregators is None for r in range(ROUNDS)) and not roles["x"].done


@pytest.mark.parametrize("bench", [True, False], ids=["benched", "control: not benched"])
def test_an_aggregator_that_vanishes_mid_round_holds_nothing_up_past_the_deadline(tmp_path, bucket, monkeypatch,
                                                                                  bench):
    """y claims its parts of round 0, then vanishes before revealing: once a reveal has had as
    long as the claims took (``REVEAL_POLLS`` polls at least), well before the deadline, the
    organizer computes every part; nobody is flagged (vanishing is no lie), and the round
    commits. y is back for round 1, but withholding cost it the role for a while (the standing
    says so, for a restarted scheduler too): round 1 is not given to it (x alone offers: the
    organizer's). Control: not benched, round 1 is theirs again."""
    if not bench:
        monkeypatch.setattr(referee, "BENCHED_ROUNDS", 0)
    run, keys = _run(tmp_path, bucket)

    def vanish(roles):
        y = roles["y"]
        compute, step = y.compute, y.step

        def compute_and_go(r, k):  # its claims are written on return; from the next poll on, gone for the round
            if r == 0:
                y.step = lambda: run.latest() > 0 and step()
            return compute(r, k)
        y.compute = compute_and_go
    states, _, _ = _collaborate(run, keys, tamper=vanish)
    close = Close.read(run, 0)
    assert states[0]["aggregated_by"] == [["organizer"]] * run.n_parts
    assert states[0]["committed_at"] < close.closed_at + (close.aggregate_by - close.closed_at) / 2
    stages = states[0]["stages"]  # the organizer's seconds of each step from CLOSE: the wait was the settling
    assert set(stages) == {"settle_s", "reduce_s", "apply_s", "judge_s"} and stages["settle_s"] > 0
    assert sum(stages.values()) <= states[0]["committed_at"] - close.closed_at
    assert flags.read(run) == {}
    assert (Close.read(run, 1).aggregators is None) == bench
    standing = referee.Referee(run, run.clock).standing  # as a restarted scheduler reads it
    assert bool(standing.benched) == bench and all(until >= 1 for until in standing.benched.values())


@pytest.mark.parametrize("renewed", [True, False], ids=["renewed", "control: not renewed"])
def test_no_wait_for_the_aggregators_lets_a_standby_take_a_live_run(tmp_path, bucket, renewed):
    """y never claims its parts, so the scheduler waits for the claims of the first exchange
    (the checks of the shards) half its share of ``aggregate_s`` (480 s: 120 s, twice the 60 s
    lease); a standby scheduler asks for the lease at every poll of the wait. The waiting
    scheduler renews it as it waits: the standby never gets it, and the round commits. Control:
    not renewed, the standby takes the run over mid-round."""
    from dedloc_pipeline.organizer.lease import Lease, LeaseHeld, LeaseLost
    run, keys = _run(tmp_path, bucket, aggregate_s=480.0)
    standby, took = Lease(run.bucket, run.keys, run.clock, holder="standby"), []

    def ask() -> None:  # while round 0 is reduced
        if not run.bucket.exists(run.keys.close(0)) or run.latest() > 0:
            return
        try:
            standby.hold()
            took.append(run.clock.monotonic())
        except LeaseHeld:
            pass
    with LockStep(run, volunteers=True) as c:
        if not renewed:
            c.scheduler.referee.renew = lambda: None
        for n, mb in (("a", 4), ("b", 3)):
            c.join(n, mb, signer=keys[n])
        roles = {n: c.aggregate(n, keys[n]) for n in ("x", "y")}
        roles["y"]._claim = lambda w: None  # it offers, and once given its parts it is silent
        run.clock.parties.append(ask)
        c.until(lambda: run.latest() > 0, 400, "state 1")
        assert run.commit_of(1)["aggregated_by"] == [["organizer"]] * run.n_parts
        if renewed:
            assert took == []
            c.scheduler.poll()  # still its run
        else:
            assert took and took[0] < Close.read(run, 0).aggregate_by - run.commit_of(0)["committed_at"]
            with pytest.raises(LeaseLost):
                c.scheduler.poll()


def test_volunteer_aggregators_need_a_signed_run(bucket, tmp_path):
    from dedloc_pipeline.organizer.scheduler import Scheduler
    unsigned = init_run(bucket, small_config())
    with pytest.raises(RunError, match="no roster"):
        Scheduler(unsigned, volunteers=True)
    assert exchange.eligible(unsigned) is not None


def test_the_assignment_pairs_two_volunteers_and_follows_the_close():
    offers = ["x", "y", "z", "x.gpu2"]
    one, other = exchange.assign("seed-1", 8, offers), exchange.assign("seed-2", 8, offers)
    assert all(len(p) == 2 and len({q.split(".")[0] for q in p}) == 2 for p in one)
    assert one != other and exchange.assign("seed-1", 8, offers) == one
    assert exchange.assign("s", 4, ["x", "x.gpu2"]) is None


MALLORY = """
import sys
from dedloc_pipeline.volunteer.aggregator import AggregatorRole
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.trust import identity
url, name, peer, key, until, lie = sys.argv[1:]
run = Run(Bucket(url), name)
role = AggregatorRole(run, peer, identity.load(key))
honest = role.compute

def noisy(r, k):
    vectors = honest(r, k)
    vectors["params"]["values"] += 1e-3
    return vectors
if lie == "noise":
    role.compute = noisy
role.serve(lambda: run.latest() >= int(until), poll_s=0.2)
"""


def _processes(tmp_path, s3_bucket, name: str, rounds: int, lies: dict[str, str]) -> str:
    """A LAMB run on moto's S3 server as real processes: `dedloc aggregate --volunteers`, alice
    and bob computing (`dedloc worker`), carol computing and aggregating honestly (`dedloc worker
    --aggregate`), and an AggregatorRole process for each of ``lies`` (peer -> "honest" or
    "noise": its parameters shifted by 1e-3), each its own enrolled key. The processes' output."""
    keys = {n: identity.generate(tmp_path / f"{n}.pem") for n in ("org", "alice", "bob", "carol", *lies)}
    org = keys["org"]
    cfg = small_config(name, organizer_key=identity.public(org), chunks_per_part=2, codec="int8",
                       target_batch_size=32, keep_states=rounds + 1, close={"aggregate_s": 120.0}, **LAMB)
    # generous: each of the three exchanges seals its claims at half its share of that time, and no
    # answer of an honest process on a loaded machine may miss it (agreeing answers settle at once)
    run = init_run(s3_bucket, cfg, organizer=org)
    identity.update_roster(run.bucket, name, org, aggregate=["carol", *lies],
                           enroll={n: identity.public(k) for n, k in keys.items() if n != "org"})
    dedloc = os.path.join(os.path.dirname(sys.executable), "dedloc")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    url, pem = s3_bucket.url, {n: str(tmp_path / f"{n}.pem") for n in keys}
    common = ["--bucket", url, "--run", name, "--until-round", str(rounds)]
    commands = [[dedloc, "aggregate", *common, "--organizer-key", pem["org"], "--poll", "0.5", "--volunteers"]]
    commands += [[dedloc, "worker", *common, "--peer-id", p, "--key", pem[p], "--organizer", identity.public(org),
                  "--threads", "1", "--poll", "0.2", "--plain", *(["--aggregate"] if p == "carol" else [])]
                 for p in ("alice", "bob", "carol")]
    commands += [[sys.executable, "-c", MALLORY, url, name, p, pem[p], str(rounds), lie] for p, lie in lies.items()]
    return run_processes(commands, tmp_path, env, timeout_s=300)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_a_settled_round_costs_the_organizer_what_the_model_says(tmp_path, s3_bucket, optimizer):
    """On moto's S3 server, the scheduler's requests for finishing a round its two aggregators
    settle, and an aggregator's meanwhile (each party through a bucket of its own), counted where
    botocore sends them (the server's count: tests/test_requests.py), against
    ``Traffic.checked_finish`` (three polls an exchange: no claims yet; the claims, then the
    reveal; the results; and the commit's pruning) and ``Traffic.aggregating``; with AdamW, and
    with LAMB (the partial sums' exchange and the norms' record first)."""
    from dedloc_pipeline.organizer.scheduler import Scheduler
    from dedloc_pipeline.planning.planned import PlannedRun
    from dedloc_pipeline.planning.requests import Requests, Traffic
    from dedloc_pipeline.volunteer.worker import Worker
    keys = {n: identity.generate(tmp_path / f"{n}.pem") for n in ("org", "a", "b", "x", "y")}
    cfg = small_config(f"settled-{optimizer}", organizer_key=identity.public(keys["org"]), chunks_per_part=2,
                       codec="int8", close={"aggregate_s": 60.0}, **(LAMB if optimizer == "lamb" else {}))
    run = init_run(s3_bucket, cfg, organizer=keys["org"])
    identity.update_roster(run.bucket, run.name, keys["org"], aggregate=["x", "y"],
                           enroll={n: identity.public(k) for n, k in keys.items() if n != "org"})
    clock = DrivenClock(epoch=run.commit_of(0)["committed_at"])
    organizer = Run(Bucket(s3_bucket.url), run.name, organizer=keys["org"], clock=clock)
    others = Run(Bucket(s3_bucket.url), run.name, clock=clock)
    scheduler = Scheduler(organizer, parallel=2, poll_s=0, volunteers=True)
    workers = [Worker(others, n, micro_batch=4, threads=1, poll_s=0, signer=keys[n]) for n in "ab"]
    roles = [AggregatorRole(Run(Bucket(s3_bucket.url), run.name, clock=clock), n, keys[n]) for n in "xy"]
    close = None
    for _ in range(200):
        for w in workers:
            w.step()
            w.flush()
        for role in roles:
            role.step()
        if (close := scheduler.try_close(0)) is not None:
            break
    assert close is not None and close.aggregators
    clock.parties += [r.step for r in roles]
    before = [Counter(b.stats.snapshot()["requests"]) for b in (organizer.bucket, roles[0].run.bucket)]
    with ThreadPoolExecutor(2) as pool:
        commit = scheduler.finish(0, pool, close)
    got, x = (Counter(b.stats.snapshot()["requests"]) - n for b, n in zip((organizer.bucket, roles[0].run.bucket),
                                                                          before))
    for w in workers:
        w.leave()
    assert all(sorted(by) == ["x", "y"] for by in commit["aggregated_by"])
    lay = Traffic(PlannedRun(cfg))
    shards = len(close.accepted)
    want = (lay.checked_finish(polls=3) + lay.prune_volunteers(lay.volunteer_objects(shards, 2, 1), 0)
            # every chunk while neither aggregator has earned trust: with LAMB, after the checks' and
            # the sums' audits of every part, both have (``TRUSTED_AFTER``), and the answers' are sampled
            + lay.audits(shards, lay.audited(), lay.audited(cfg.close.audit if optimizer == "lamb" else None)))
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.as_dict().items() if v}
    # x, meanwhile: a view read for each stage the view says (a worker's bill has them: closed,
    # the checks and their record, the reveal; with LAMB the sums and the norms too) and its
    # share, every part here
    want = lay.aggregating(shards, run.n_parts) + Requests(get=4 + 2 * (optimizer == "lamb"))
    assert {k: v for k, v in x.items() if v} == {k: v for k, v in want.as_dict().items() if v}


@pytest.mark.parametrize("sealed, lamb", [(True, False), (True, True), (False, False)],
                         ids=["sealed", "sealed, lamb", "control: not sealed"])
def test_a_claim_rewritten_after_the_reveal_gains_nothing_from_a_restart(tmp_path, bucket, monkeypatch, sealed,
                                                                          lamb):
    """x claims a made-up answer; the scheduler seals the claims, reveals, and dies. y reveals;
    x copies y's answer and result and rewrites its claim to match. The restarted scheduler holds
    every result to the claims sealed before the reveal: x is flagged, every part the
    organizer's. With LAMB the restart also takes the norms it recorded before (the sums' stage
    is not run again). Control, nothing sealed: the restart reads the rewritten claim, and x is
    credited with parts it never computed (the state is still right: y's answer)."""
    from dedloc_pipeline.organizer.scheduler import Scheduler
    run, keys = _run(tmp_path, bucket, **(LAMB if lamb else {}))
    if not sealed:
        monkeypatch.setattr(referee.Referee, "_sealed", lambda self, close, stage: None)

    class Killed(Exception):
        pass
    with LockStep(run, volunteers=True) as c:
        for n, mb in (("a", 4), ("b", 3)):
            c.join(n, mb, signer=keys[n])
        x, y = c.aggregate("x", keys["x"]), c.aggregate("y", keys["y"])
        honest = x.compute
        x.compute = lambda r, k: {n: {a: np.zeros_like(v) for a, v in arrays.items()}
                                  for n, arrays in honest(r, k).items()}
        publish = c.scheduler._publish

        def killed_after_the_reveal(*a, **kw):
            publish(*a, **kw)
            if kw.get("reveal") == "parts":
                raise Killed
        c.scheduler._publish = killed_after_the_reveal
        with pytest.raises(Killed):
            c.until(lambda: run.latest() > 0, 400, "state 1")
    y.step()  # the view says reveal: y's answers and results
    for k in range(run.n_parts):
        theirs = run.bucket.read_json(run.keys.result(0, "y", k))["checksums"]
        for key in run.bucket.listing(run.keys.answer(0, "y", k)):
            run.bucket.copy(key, key.replace("/volunteers/y/", "/volunteers/x/"))
        x._write(run.keys.result(0, "x", k), {"round": 0, "peer": "x", "part": k, "checksums": theirs})
        x._write(run.keys.claim(0, "x", k), {"round": 0, "peer": "x", "part": k,
                                             "digest": exchange.digest("x", theirs)})
    with ThreadPoolExecutor(2) as pool:
        commit = Scheduler(run, 2, 0, volunteers=True).finish(0, pool, Close.read(run, 0))
    assert commit["checksums"] == _organizers(run, 0)
    if sealed:
        assert commit["aggregated_by"] == [["organizer"]] * run.n_parts
        assert list(flags.read(run)) == ["x"] and "other than it claimed" in flags.read(run)["x"].reason
    else:
        assert all(sorted(by) == ["x", "y"] for by in commit["aggregated_by"]) and flags.read(run) == {}


PADDED = b'{"pad": "' + b"p" * (2 << 20) + b'"}'  # 2 MB: far over any record's bound


def _results_of_x(run, key: str) -> bool:
    return (w := run.keys.written(key)) is not None and w.peer == "x" and w.kind == "result"


@pytest.mark.parametrize("when", ["listed", "raced"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "control: unbounded"])
def test_an_oversized_result_is_refused_unread(tmp_path, bucket, monkeypatch, bounded, when):
    """x reveals, then rewrites its result as 2 MB of padding: ``listed``, before the scheduler
    lists it (its listed size is over the record's bound, ``exchange.bound``: never downloaded);
    ``raced``, between the listing and the read (the read is ranged: at most the bound and a
    byte come down). Either way the parts are the organizer's. Control: without the bound the
    scheduler downloads the 2 MB before its schema refuses them."""
    run, keys = _run(tmp_path, bucket)
    if not bounded:
        monkeypatch.setattr(exchange, "bound", lambda run, model, shards=0: 2 * len(PADDED))
    read, original = {}, run.bucket.read_if_changed

    def reading(key, tag, limit=None):
        if when == "raced" and _results_of_x(run, key):
            run.bucket.write_bytes(key, PADDED)  # rewritten just after the scheduler listed it
        got = original(key, tag, limit)
        read[key] = len(got.data or b"")
        return got
    monkeypatch.setattr(run.bucket, "read_if_changed", reading)

    def bloat(roles):
        x, step = roles["x"], roles["x"].step

        def then_bloat():
            step()
            for (r, k), done in x.done.items():
                if done.revealed and when == "listed":
                    run.bucket.write_bytes(run.keys.result(r, "x", k), PADDED)
        x.step = then_bloat
    states, _, _ = _collaborate(run, keys, tamper=bloat)
    assert all(c["aggregated_by"] == [["organizer"]] * run.n_parts for c in states)
    downloaded = {k: n for k, n in read.items() if _results_of_x(run, k)}
    most = max(downloaded.values(), default=0)
    if not bounded:
        assert most >= len(PADDED)
    elif when == "listed":
        assert downloaded == {}
    else:
        assert downloaded and most == exchange.bound(run, exchange.Result) + 1
    assert flags.read(run) == {}


@pytest.mark.slow
def test_real_processes_on_s3_honest_aggregators_agree_and_two_names_of_one_person_are_caught(tmp_path, s3_bucket):
    """On moto's S3 server, a LAMB run (sahajBERT's recipe: the partial sums' exchange, then the
    steps'): `dedloc aggregate --volunteers`, alice and bob computing (`dedloc worker`), carol
    computing and aggregating honestly (`dedloc worker --aggregate`), dave aggregating honestly
    (the real AggregatorRole), and mallory and her second name eve (two keys, one person)
    aggregating in two processes that tell the same lie (their parameters shifted by 1e-3), so
    they agree wherever CLOSE gives them the same part. No committed part differs from the
    organizer's own answer (a part of the colluders' is found by its audit, one a liar shares with
    an honest aggregator by the disagreement), both end flagged and nobody else, every part the
    colluders shared was audited and found; and the honest pair, computing apart in processes of
    their own, agree: their parts are committed as their answers (with the liars flagged, they
    alone are paired)."""
    rounds, name = 4, "aggregators"
    tails = _processes(tmp_path, s3_bucket, name, rounds, {"dave": "honest", "mallory": "noise", "eve": "noise"})
    run = Run(s3_bucket, name)
    commits = [run.commit_of(s) for s in range(1, rounds + 1)]
    for r, commit in enumerate(commits):
        assert commit["checksums"] == _organizers(run, r), f"state {r + 1} is not the organizer's answer\n{tails}"
        assert all(sorted(by) in (["organizer"], ["carol", "dave"]) for by in commit["aggregated_by"]), tails
    assigned = [r for r in range(rounds) if Close.read(run, r).aggregators]
    assert assigned, f"no round had two aggregators offering\n{tails}"
    assert sorted(flags.read(run)) == ["eve", "mallory"], tails
    assert any(sorted(by) == ["carol", "dave"] for c in commits for by in c["aggregated_by"]), tails
    for r in assigned:
        found = run.read_record(run.keys.audits(r), "audits", round=r) or {"audits": []}
        for k, pair in enumerate(Close.read(run, r).aggregators):
            if sorted(pair) == ["eve", "mallory"]:
                assert any(a["part"] == k and a["found"] for a in found["audits"]), (r, k, found)
