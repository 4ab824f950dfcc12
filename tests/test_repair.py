"""`dedloc repair` on real runs, one kind of damage each: the dry run names the key at fault and
changes nothing, --apply moves what is damaged under the run's quarantine and reopens the newest
intact state's round, and the run goes on from there."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.compute import aggregation
from dedloc_pipeline.organizer import repair
from dedloc_pipeline.organizer.lease import Lease
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.run import Run, RunError, init_run
from dedloc_pipeline.storage import vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.testing import FakeClock, LockStep, written
from dedloc_pipeline.trust import identity

from .conftest import small_config

PEERS = [("p0", 4), ("p1", 8)]
NEWEST = 5  # states 4 and 5 whole (keep_states 2), 2 and 0 checkpoints, 1 and 3 pruned


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """The folder of a bucket whose run ``r`` has NEWEST committed states and no live scheduler."""
    root = tmp_path_factory.mktemp("repair") / "bucket"
    run = init_run(Bucket(f"file://{root}"), small_config("r", keep_states=2, checkpoint_every=2))
    with LockStep(run) as c:
        for peer, mb in PEERS:
            c.join(peer, mb)
        c.until(lambda: run.latest() >= NEWEST)
        c.scheduler.lease.release()
    return root


@pytest.fixture
def run(committed, tmp_path) -> Run:
    """A copy of that run for one test to damage, on a fake clock from now on."""
    shutil.copytree(committed, tmp_path / "bucket")
    return Run(Bucket(f"file://{tmp_path}/bucket"), "r", clock=FakeClock(epoch=time.time()))


def where(run: Run) -> list[str]:
    return ["--bucket", run.bucket.url, "--run", run.name]


def objects(run: Run) -> dict:
    """Every object of the run with its size and version tag: what a dry run must leave as it is."""
    return run.bucket.listing(run.keys.root)


def dry_run(run: Run) -> tuple[repair.Plan, list[str]]:
    """The plan and what the dry run says; checks it changed nothing and exits as damage does."""
    before, lines = objects(run), []
    assert repair.repair(run, False, lines.append) is False
    assert objects(run) == before
    return repair.diagnose(run), lines


def quarantined(run: Run, key: str) -> bytes | None:
    """``key`` as the one repair so far kept it."""
    (stamp,) = run.bucket.list(run.keys.quarantine_dir)
    return run.bucket.read_bytes(run.keys.quarantined(stamp, key))


def goes_on(run: Run, state: int) -> None:
    """Volunteers and a scheduler commit up to ``state`` from where the repair left the run; the
    volunteers restarted once their heartbeats of before are older than a peer's timeout (until
    then a peer id still heartbeating is refused as a twin)."""
    run.clock.advance(run.config.peer_timeout_s)
    with LockStep(run, step_s=0.5) as c:
        for peer, mb in PEERS:
            c.join(peer, mb)
        c.until(lambda: run.latest() >= state, what=f"state {state}")
        c.scheduler.lease.release()
    assert repair.diagnose(run).healthy


def close_round(run: Run) -> None:
    """The open round closed by a scheduler from volunteers' shards, not yet reduced."""
    r, sched = run.latest(), Scheduler(run, 2, 0)
    with LockStep(run, scheduler=False) as c:
        for peer, mb in PEERS:
            c.join(peer, mb)
        c.until(lambda: sched.try_close(r), what=f"round {r} closed")
    sched.lease.release()


def chunk(run: Run, s: int, i: int, of: str = "params") -> str:
    key = run.keys.params(s) if of == "params" else run.keys.delta(s)
    fmt = run.dense_format if of == "params" else run.delta_format
    return f"{key}/{vector.chunk_object(fmt, next(iter(fmt.arrays())), i)}"


def flip(run: Run, key: str) -> bytes:
    """Flip bytes inside a stored object, as a failing disk would; returns what is stored now."""
    data = bytearray(run.bucket.read_bytes(key))
    data[32:40] = bytes(b ^ 0xFF for b in data[32:40])
    run.bucket.write_bytes(key, bytes(data))
    return bytes(data)


def truncate(run: Run, key: str) -> bytes:
    data = run.bucket.read_bytes(key)[:-40]
    run.bucket.write_bytes(key, data)
    return data


def test_a_healthy_run_has_nothing_to_repair(run):
    res = cli("repair", *where(run))
    assert res.exit_code == 0 and res.output == f"run r: state {NEWEST} is intact, nothing to repair\n", res.output
    close_round(run)  # a round in flight is no damage: closed, reduced in part
    aggregation.reduce_part(run, NEWEST, 0)
    assert repair.diagnose(run) == repair.Plan(NEWEST)
    assert repair.repair(run, True, lambda line: None)


def test_a_truncated_commit_falls_back_to_the_state_below(run):
    """The first report: `Unterminated string…` from every command; the way back is named there."""
    key = run.keys.commit(NEWEST)
    good = run.bucket.read_bytes(key)
    cut = good.index(b'"contributors"') + 5  # inside a string, as the first report's was
    run.bucket.write_bytes(key, good[:cut])
    res = cli("status", *where(run))
    assert res.exit_code == 2 and "is damaged: not JSON" in res.stderr
    assert res.stderr.rstrip().endswith("; run `dedloc repair` to see and repair it"), res.stderr
    before = objects(run)
    res = cli("repair", *where(run))
    assert res.exit_code == 1, res.output
    assert f"COMMIT: {key}: not JSON (Unterminated string" in res.output
    assert f"LATEST: {run.keys.latest}: points to state {NEWEST}, which is damaged" in res.output
    assert f"would move {run.keys.state(NEWEST)} to " in res.output
    assert f"go on from state {NEWEST - 1}, round {NEWEST - 1} open again" in res.output
    assert objects(run) == before
    res = cli("repair", *where(run), "--apply")
    assert res.exit_code == 0, res.output
    assert f"repaired: the run goes on from state {NEWEST - 1}, round {NEWEST - 1} open again" in res.output
    assert run.latest() == NEWEST - 1 and run.bucket.read_json(run.keys.latest) == {"state": NEWEST - 1}
    assert quarantined(run, key) == good[:cut]
    assert not run.bucket.exists(run.keys.close(NEWEST - 1))  # it closes anew from its shards
    assert written(run, NEWEST - 1)  # which stay
    assert cli("repair", *where(run)).exit_code == 0
    goes_on(run, NEWEST)


def test_a_bad_parameter_chunk_is_named_and_its_state_moved(run):
    key = chunk(run, NEWEST, 2)
    flipped = flip(run, key)
    plan, lines = dry_run(run)
    assert plan.state == NEWEST - 1
    assert [(f.kind, f.key) for f in plan.findings][:1] == [("params", key)], plan.findings
    assert any(line.startswith(f"params: {key}: ") for line in lines), lines
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == NEWEST - 1
    assert quarantined(run, key) == flipped and not run.bucket.exists(key)
    goes_on(run, NEWEST)


def test_a_close_on_a_damaged_state_is_moved_and_its_round_reopened(run):
    """The issue's second case: a parameter chunk truncated after the scheduler closed the next
    round, whose aggregators then cannot apply it."""
    close_round(run)
    key = chunk(run, NEWEST, 1)
    truncate(run, key)
    with ThreadPoolExecutor(2) as pool, pytest.raises(vector.CorruptShard):
        Scheduler(run, 2, 0).finish(NEWEST, pool)
    assert run.bucket.find(run.keys.reduced_dir(NEWEST)) and run.bucket.find(run.keys.state(NEWEST + 1))
    plan, lines = dry_run(run)
    found = {(f.kind, f.key) for f in plan.findings}
    assert {("params", key), ("CLOSE", run.keys.close(NEWEST)), ("stray", run.keys.state(NEWEST + 1)),
            ("CLOSE", run.keys.close(NEWEST - 1)), ("LATEST", run.keys.latest)} <= found, plan.findings
    assert f"CLOSE: {run.keys.close(NEWEST)}: round {NEWEST} is closed on state {NEWEST}, which is damaged" in lines
    assert {run.keys.state(NEWEST + 1), run.keys.state(NEWEST), run.keys.close(NEWEST), run.keys.reduced_dir(NEWEST),
            run.keys.close(NEWEST - 1), run.keys.reduced_dir(NEWEST - 1)} <= set(plan.moved)
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == NEWEST - 1
    assert not run.bucket.find(run.keys.state(NEWEST + 1)) and not run.bucket.exists(run.keys.close(NEWEST))
    assert json.loads(quarantined(run, run.keys.close(NEWEST)))["round"] == NEWEST
    goes_on(run, NEWEST + 1)  # round NEWEST's old shards name the old state: refused, and new ones fill it


@pytest.mark.parametrize("latest, problem", [
    (b'{"state": 5', "not JSON (Expecting ',' delimiter"),
    (b'{"state": 9}', "points to state 9, which does not exist"),
])
def test_a_bad_latest_is_rewritten(run, latest, problem):
    run.bucket.write_bytes(run.keys.latest, latest)
    plan, lines = dry_run(run)
    assert plan == repair.Plan(NEWEST, plan.findings, latest=True)
    assert lines[0].startswith(f"LATEST: {run.keys.latest}: {problem}"), lines
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == NEWEST and run.bucket.read_json(run.keys.latest) == {"state": NEWEST}
    assert not run.bucket.find(run.keys.quarantine_dir)  # nothing was moved
    goes_on(run, NEWEST + 1)


def test_a_latest_naming_no_state_is_read_around_and_the_next_commit_rewrites_it(run, caplog):
    """The report: LATEST naming a state that does not exist stopped a worker with a TypeError,
    `status` showed the missing state as current and a scheduler said it was committed. Readers
    take the newest state with a COMMIT (saying so once), the run goes on without a repair, and
    its next COMMIT rewrites LATEST."""
    run.bucket.write_json(run.keys.latest, {"state": 9})
    fresh = Run(run.bucket, run.name, clock=run.clock)
    with caplog.at_level("WARNING"):
        assert fresh.latest() == NEWEST and fresh.latest() == NEWEST
    assert [r.getMessage() for r in caplog.records if "LATEST names" in r.getMessage()] == [
        f"run {run.name}: LATEST names state 9, which has no COMMIT; state {NEWEST} is the newest committed "
        "(`dedloc repair --apply` rewrites LATEST)"]
    res = CliRunner().invoke(app, ["status", "--bucket", run.bucket.url, "--run", run.name, "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["round"] == NEWEST, res.output
    goes_on(run, NEWEST + 1)
    assert run.bucket.read_json(run.keys.latest)["state"] == run.latest() >= NEWEST + 1


@pytest.mark.parametrize("state,line", [
    (3, "error: state 3 of run '{run}': its parameters were pruned (kept: the multiples of 2 and the last 2; here "
        "0, 2, 4, 5)"),
    (9, "error: state 9 of run '{run}' is not committed (the newest is 5)")])
def test_export_of_a_state_it_cannot_have_says_why(run, tmp_path, state, line):
    """The report: `export` of a pruned state said `chunk checksum mismatch`, which reads as damage."""
    res = CliRunner().invoke(app, ["export", "--bucket", run.bucket.url, "--run", run.name, "--state", str(state),
                                   "--out", str(tmp_path / "model")])
    assert res.exit_code == 2 and res.stderr.strip() == line.format(run=run.name), res.output
    assert not (tmp_path / "model").exists()


def test_an_older_damaged_commit_is_read_around_and_named(run, tmp_path):
    """The report: an older damaged COMMIT stopped status, report and plot ("run `dedloc
    repair`"), and repair said the newest state was intact, nothing to repair: a dead end. Now
    monitoring reads around it and names it, and repair says what it is and what can be done."""
    from dedloc_pipeline.monitoring.status import status
    key = run.keys.commit(2)
    run.bucket.write_bytes(key, b'{"state": 2, "trunc')
    s = status(run)
    assert list(s["damaged"]) == [key] and [h["round"] for h in s["history"]] == [0, 2, 3, 4]
    res = cli("status", "--bucket", run.bucket.url, "--run", run.name)
    shown = " ".join(res.output.split())  # rich wraps it to the terminal's width
    assert res.exit_code == 0 and f"damaged, left out of the history: {key} (an older state's COMMIT" in shown
    res = cli("report", "--bucket", run.bucket.url, "--run", run.name, "--out", str(tmp_path / "r.html"))
    assert res.exit_code == 0 and f"damaged, left out of the history: {key}" in (tmp_path / "r.html").read_text()
    res = cli("repair", "--bucket", run.bucket.url, "--run", run.name)
    lines = res.output.splitlines()
    assert res.exit_code == 0 and lines[0].startswith(f"COMMIT: {key}: not JSON (") and \
        "status, report and plot read around it" in lines[0], res.output
    assert lines[-1] == f"run {run.name}: state {NEWEST} is intact, the run goes on from it"


def test_a_bad_delta_costs_no_state(run):
    """Peers fall back to the snapshot when a delta does not match: the state stays, its delta goes."""
    key = chunk(run, NEWEST, 0, of="delta")
    flip(run, key)
    plan, _ = dry_run(run)
    assert plan.state == NEWEST and not plan.reopened and plan.moved == (run.keys.delta(NEWEST),)
    assert [(f.kind, f.key) for f in plan.findings] == [("delta", key)]
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == NEWEST and not run.bucket.find(run.keys.delta(NEWEST))
    goes_on(run, NEWEST + 1)


def test_with_every_whole_state_damaged_it_falls_back_to_a_checkpoint(run):
    """States 5 and 4 are damaged and 3 is pruned: the run goes back to checkpoint 2, and the
    intact COMMIT of state 3 is kept in the quarantine with the rest."""
    truncate(run, run.keys.commit(5))
    flip(run, chunk(run, 4, 0))
    plan, lines = dry_run(run)
    assert plan.state == 2 and plan.checkpoint and plan.states == (5, 4, 3)
    assert ("pruned", run.keys.params(3)) in {(f.kind, f.key) for f in plan.findings}
    assert lines[-1].startswith("the run would go on from checkpoint state 2, round 2 open again")
    committed_3 = run.bucket.read_bytes(run.keys.commit(3))
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == 2 and quarantined(run, run.keys.commit(3)) == committed_3
    assert not any(run.bucket.exists(run.keys.close(r)) for r in (2, 3, 4))
    assert run.bucket.exists(run.keys.close(1)) and run.bucket.exists(run.keys.commit(1))  # the ledger below
    goes_on(run, 3)


def test_a_run_without_an_intact_state_says_it_cannot_be_repaired(tmp_path):
    run = init_run(Bucket(f"file://{tmp_path}/bucket"), small_config("r"))
    truncate(run, run.keys.commit(0))
    res = cli("repair", *where(run))
    assert res.exit_code == 1 and f"COMMIT: {run.keys.commit(0)}: not JSON" in res.output
    assert "cannot be repaired" in res.output
    before = objects(run)
    res = cli("repair", *where(run), "--apply")
    assert res.exit_code == 2 and "cannot be repaired from what the bucket holds" in res.stderr
    assert objects(run) == before


def test_a_signed_run_needs_the_organizer_to_rewrite_latest(tmp_path, monkeypatch):
    monkeypatch.delenv("DEDLOC_ORGANIZER_KEY", raising=False)
    key_file = str(tmp_path / "organizer.pem")
    org = identity.generate(key_file)
    run = init_run(Bucket(f"file://{tmp_path}/bucket"), small_config("r", organizer_key=identity.public(org)), org)
    run.bucket.write_json(run.keys.latest, {"state": 0})  # not signed: anyone could have written it
    res = cli("repair", *where(run))
    assert res.exit_code == 1 and "LATEST: " in res.output and "not signed by the run's organizer" in res.output
    before = objects(run)
    res = cli("repair", *where(run), "--apply")
    assert res.exit_code == 2 and "needs the organizer's private key" in res.stderr
    assert objects(run) == before
    res = cli("repair", *where(run), "--apply", "--organizer-key", key_file)
    assert res.exit_code == 0, res.output
    assert run.read_record(run.keys.latest, "LATEST")["state"] == 0


def test_a_live_scheduler_is_stopped_first(run):
    run.bucket.write_bytes(run.keys.latest, b"{")
    Lease(run.bucket, run.keys, run.clock, holder="elsewhere:7").hold()
    lines = []
    assert repair.repair(run, False, lines.append) is False
    assert any(line.startswith("note: run r is scheduled by elsewhere:7") for line in lines)
    with pytest.raises(RunError, match=r"scheduled by elsewhere:7 .*: stop that scheduler before repairing"):
        repair.repair(run, True, lines.append)


def test_the_way_back_is_named_only_for_what_repair_sees():
    assert repair.advice("runs/r/state/00000003/COMMIT.json") == "; run `dedloc repair` to see and repair it"
    assert repair.advice("runs/r/rounds/00000003/CLOSE.json")
    assert repair.advice("runs/r/ROSTER.json") == repair.advice("data/x/DATA.json") == repair.advice(None) == ""


def test_on_s3_the_same_repair_moves_objects_and_prefixes_alike(s3_bucket):
    """On S3 a CLOSE is one object and a state a prefix of many: both are found, copied and taken away."""
    base = init_run(s3_bucket, small_config("r"))
    run = Run(s3_bucket, "r", clock=FakeClock(epoch=base.commit_of(0)["committed_at"]))
    goes_on(run, 2)
    truncated = truncate(run, run.keys.commit(2))
    plan, _ = dry_run(run)
    assert plan.state == 1 and {run.keys.state(2), run.keys.close(1)} <= set(plan.moved)
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == 1 and quarantined(run, run.keys.commit(2)) == truncated
    assert quarantined(run, run.keys.close(1)) is not None and not run.bucket.exists(run.keys.close(1))
    goes_on(run, 2)


def test_a_repair_cut_short_is_finished_by_running_it_again(run, monkeypatch):
    """Cut off as it takes the first marker away (the CLOSE), after the scratch: the run still
    reads as damaged, and the next repair finishes the job."""
    truncate(run, run.keys.commit(NEWEST))
    delete = run.bucket.delete

    def cut(key):
        if key == run.keys.close(NEWEST - 1):
            raise ConnectionError("the organizer's laptop lost its network")
        delete(key)
    monkeypatch.setattr(run.bucket, "delete", cut)
    with pytest.raises(ConnectionError):
        repair.repair(run, True, lambda line: None)
    monkeypatch.setattr(run.bucket, "delete", delete)
    assert not repair.diagnose(run).healthy
    run.clock.advance(1)  # the next repair's own quarantine
    assert repair.repair(run, True, lambda line: None)
    assert run.latest() == NEWEST - 1
    goes_on(run, NEWEST)
