"""The dollar cost of a collaboration: the price table, the arithmetic of a bill, and the planned
run's request counts against one real round on moto's S3 server, counted as botocore sends them."""

from __future__ import annotations

import inspect
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.organizer import ledger, scheduler
from dedloc_pipeline.planning import prices
from dedloc_pipeline.planning.estimate import SAMPLES_PER_S, _count, estimate, measured
from dedloc_pipeline.planning.planned import PlannedRun, n_params
from dedloc_pipeline.planning.requests import PRUNE_WINDOW, Requests, Traffic
from dedloc_pipeline.protocol import shard, view
from dedloc_pipeline.protocol.config import RunConfig, recipe_config
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage import codec


def _priced(s3=(5.0, 0.4), egress=0.09) -> dict:
    put, get = s3
    return {"date": "2027-01-01", "source": "test", "gigabyte": 10**9, "providers": {"cheap": {
        "name": "Cheap", "per_million": {"put": put, "list": put, "get": get, "head": get, "delete": 0},
        "egress_per_gb": egress, "storage_per_gb_month": 0.02}}}


# prices

def test_the_price_table_is_dated_and_names_its_sources():
    p = prices.PRICES
    assert str(p.date) == "2026-12-01" and "aws.amazon.com" in p.source and "cloudflare" in p.source
    s3, r2 = p.providers["s3"], p.providers["r2"]
    assert s3.request_price("put") == s3.request_price("list") == 5.0  # $0.005 per 1,000
    assert s3.request_price("get") == s3.request_price("head") == 0.4 and s3.request_price("delete") == 0
    assert (s3.egress_per_gb, s3.ingress_per_gb, s3.storage_per_gb_month) == (0.09, 0, 0.023)
    assert (r2.request_price("put"), r2.request_price("get"), r2.egress_per_gb, r2.storage_per_gb_month) == (
        4.5, 0.36, 0, 0.015)


def test_an_override_file_replaces_the_table(tmp_path):
    f = tmp_path / "prices.json"
    f.write_text(json.dumps(_priced()))
    table = prices.load_prices(f)
    assert list(table.providers) == ["cheap"] and table.gigabyte == 10**9
    assert prices.load_prices(_dump(tmp_path, prices.PRICES.model_dump(mode="json"))) == prices.PRICES  # round trip


def _dump(tmp_path, obj) -> str:
    f = tmp_path / "table.json"
    f.write_text(json.dumps(obj))
    return str(f)


@pytest.mark.parametrize("content,says", [
    ("{not json", "not a JSON file"),
    (json.dumps({"date": "2027-01-01", "source": "x", "providers": {}}), "providers"),
    (json.dumps(_priced(egress=-1)), "egress_per_gb"),
    (json.dumps({**_priced(), "vat": 0.2}), "vat"),
])
def test_a_bad_price_file_says_what_is_wrong(tmp_path, content, says):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=says) as exc:
        prices.load_prices(f)
    assert str(f) in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="no such file"):
        prices.load_prices(tmp_path / "missing.json")


# bills

def test_a_bill_prices_each_class_and_the_egress():
    b = prices.bill({"put": 1000, "list": 2000, "get": 1_000_000, "head": 500_000, "delete": 7},
                  bytes_out=5 * 2**30, bytes_in=10 * 2**30, provider="s3", gb_months=100)
    assert b.requests == pytest.approx({"put": 0.005, "list": 0.01, "get": 0.4, "head": 0.2, "delete": 0})
    assert (b.egress, b.ingress, b.storage) == pytest.approx((0.45, 0, 2.3))
    assert b.total == pytest.approx(0.005 + 0.01 + 0.4 + 0.2 + 0.45 + 2.3)
    r2 = prices.bill({"put": 2_000_000, "get": 10_000_000}, bytes_out=10**12, bytes_in=0, provider="r2")
    assert r2.total == pytest.approx(9.0 + 3.6)  # egress free


def test_a_bill_prices_unnamed_kinds_as_other_and_refuses_unknown_providers():
    assert prices.bill({"post": 1e6, "weird": 1e6}, 0, 0, "s3").requests == {"post": 5.0, "weird": 0.4}
    table = prices.PriceTable.model_validate(_priced())
    with pytest.raises(ValueError, match="no price for 'post'"):
        prices.bill({"post": 1}, 0, 0, "cheap", table)
    with pytest.raises(ValueError, match="no provider 'gcs'"):
        prices.bill({}, 0, 0, "gcs")


def test_a_measured_snapshot_per_volunteer_hour_and_day():
    snap = {"requests": {"get": 7200, "put": 3600}, "bytes_read": 2 * 2**30, "bytes_written": 2**30}
    m = measured(snap, seconds=1800, volunteers=2)  # two volunteers for half an hour: one volunteer-hour
    assert m.volunteer_hour.requests == {"get": 7200, "put": 3600}
    assert (m.volunteer_hour.bytes_down, m.volunteer_hour.bytes_up) == (2 * 2**30, 2**30)
    s3 = m.cost["s3"]
    assert s3.volunteer_hour.total == pytest.approx(7200 * 0.4e-6 + 3600 * 5e-6 + 2 * 0.09)
    assert s3.volunteer_day.total == pytest.approx(24 * s3.volunteer_hour.total)
    assert m.cost["r2"].volunteer_hour.egress == 0


# the model against the protocol

# FlatLayout(build_model(preset)).n, measured once (tests/test_presets.py builds them)
MEASURED_PARAMS = {("micro", None): 304_402, ("tiny", None): 1_971_138, ("tiny", 256): 1_987_522,
                   ("small", None): 5_628_930, ("sahajbert", None): 18_105_474}


@pytest.mark.parametrize("preset,seq_len", sorted(MEASURED_PARAMS, key=str))
def test_parameter_counts_from_the_preset_alone(preset, seq_len):
    assert n_params(preset, seq_len) == MEASURED_PARAMS[preset, seq_len]


def test_the_constants_the_model_copies_from_torch_modules():
    assert inspect.signature(ledger.prune).parameters["window"].default == PRUNE_WINDOW


def _requests(bucket) -> Counter:
    return Counter(bucket.stats.snapshot()["requests"])


def _close(got: Counter, want: Requests) -> None:
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.as_dict().items() if v}


ROUNDS_ON_S3 = {"adamw-3-parts": dict(chunks_per_part=3, optimizer={"name": "adamw"}),
                "lamb-1-part": dict(chunks_per_part=4, optimizer={"name": "lamb"}),
                # one optimizer slot (the outer step's momentum), sparse shards and deltas
                "diloco-sparse-3-parts": dict(chunks_per_part=3, algorithm="diloco", codec="sparse",
                                              close={"min_descent": -1e9})}  # shards of noise: scored, kept


@pytest.fixture(scope="module", params=list(ROUNDS_ON_S3))
def round_on_s3(request, s3_endpoint, tmp_path_factory):
    """One real round on moto, each step's requests counted by the bucket (the counters equal the
    server's own log: tests/test_requests.py): a poll, an upload, the closing poll, finish, a
    state download, a second round's finish (from the state the scheduler kept), and prune of a
    state that leaves the window and of states already gone. The
    request model sees the run as planned (its config alone)."""
    mp = pytest.MonkeyPatch()
    for k, v in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                     AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s3_endpoint).items():
        mp.setenv(k, v)
    from dedloc_pipeline.storage.bucket import Bucket
    name = f"cost-{request.param.split('-')[0]}-{time.time_ns() % 10**9}"
    Bucket(f"s3://{name}").fs.mkdir(name)
    bucket = Bucket(f"s3://{name}/c")
    # 4 chunks (the last one short) in parts of 3 and 1, or in one; int8 shards and int4 deltas, or sparse
    config = RunConfig(run="cost", seq_len=32, chunk_size=1 << 19, target_batch_size=8,
                       **{"codec": "int8", **ROUNDS_ON_S3[request.param]})
    run = init_run(bucket, config)
    keys, steps = run.keys, {}

    def counted(label, fn):
        before = _requests(bucket)
        out = fn()
        steps[label] = _requests(bucket) - before
        return out

    sched = scheduler.Scheduler(run, 2, 0)
    peers = ["p0", "p1"]
    for p in peers:
        bucket.write_json(keys.progress(0, p), {"peer": p, "round": 0, "samples": 4, "samples_per_s": 1.0,
                                                "time": time.time()})
    counted("lease", sched.lease.hold)
    counted("poll", lambda: sched.wait_close(0, deadline=time.monotonic() - 1))
    counted("view", lambda: view.read(bucket, keys))
    rng, opened = np.random.default_rng(0), shard.commit_hash(run.commit_of(0))
    inner = [4] if config.algorithm == "diloco" else None  # one inner step of its 4 samples
    for i, p in enumerate(peers):
        arrays = codec.encode(rng.standard_normal(run.grad_format.n).astype(np.float32), config.codec,
                              config.block_size)
        counted(f"upload {p}", lambda: shard.upload(run, 0, p, f"part{i}", arrays, 4, 1.0,
                                                    shard.DataRef(stream=p, ranges=[(0, 4)]),
                                                    state_hash=opened, inner_steps=inner))  # as a worker has it
    close = counted("closing", lambda: sched.try_close(0))
    assert close is not None
    with ThreadPoolExecutor(2) as pool:  # the round loop finishes the CLOSE it has
        counted("finish", lambda: sched.finish(0, pool, close))
    p0 = run.load_params(0)
    counted("download", lambda: run.apply_delta(1, p0, run.commit_of(1)))
    counted("between rounds", sched.poll)
    for i, p in enumerate(peers):  # round 1: its step from the state this scheduler kept
        arrays = codec.encode(rng.standard_normal(run.grad_format.n).astype(np.float32), config.codec,
                              config.block_size)
        shard.upload(run, 1, p, f"part{i}", arrays, 4, 1.0, shard.DataRef(stream=p, ranges=[(4, 4)]),
                     state_hash=shard.commit_hash(run.commit_of(1)), inner_steps=inner)
    close = sched.try_close(1)
    assert close is not None
    with ThreadPoolExecutor(2) as pool:
        counted("finish kept", lambda: sched.finish(1, pool, close))
    counted("prune state 1", lambda: ledger.prune(run, 1 + config.keep_states))
    counted("prune again", lambda: ledger.prune(run, 4 + config.keep_states))
    yield run, Traffic(PlannedRun(config)), steps
    mp.undo()


def test_the_plan_is_the_run(round_on_s3):
    """Planned from its config alone (no model), a run has the real one's vectors, parts and slots."""
    run, lay, _ = round_on_s3
    planned = PlannedRun(run.config)
    assert planned.flat.n == run.flat.n
    assert (planned.grad_format, planned.delta_format, planned.dense_format) == (
        run.grad_format, run.delta_format, run.dense_format)
    assert lay.parts == [len(run.part_chunks(k)) for k in range(run.n_parts)] in ([3, 1], [4])


def test_a_poll_and_a_shard_upload_cost_what_the_model_says(round_on_s3):
    run, lay, steps = round_on_s3
    _close(steps["lease"], Requests(list=1, put=1))  # no lease yet: one created
    _close(steps["poll"], lay.scheduler_poll(heartbeats=2, manifests=0, first=True))
    _close(steps["view"], Requests(get=1))
    _close(steps["upload p0"], lay.shard_upload())
    # codes and scales packed in one object of its 4 chunks, or sparse indices, codes and scales
    # (one object each; the metadata the run's), then the manifest
    arrays = 3 if run.config.codec == "sparse" else 1
    assert lay.shard_upload() == Requests(put=arrays + 1)


def test_closing_finishing_and_a_state_download_cost_what_the_model_says(round_on_s3):
    run, lay, steps = round_on_s3
    _close(steps["closing"], lay.scheduler_poll(heartbeats=0, manifests=2) + lay.closing(2))
    # the commit's pruning lists the volunteers' prefixes (round 0 is still kept: nothing goes)
    _close(steps["finish"], lay.finish(2, first=True) + lay.prune_volunteers(lay.volunteer_objects(2, 2, 1), 0))
    _close(steps["download"], lay.state_download())
    arrays = 3 if run.config.codec == "sparse" else 2
    assert lay.state_download() == Requests(get=1 + arrays * 4)  # the COMMIT, the delta's chunks
    _close(steps["between rounds"], lay.between_rounds())
    # its commit prunes round 0 out of the volunteers' prefixes
    _close(steps["finish kept"], lay.finish(2) + lay.prune_volunteers(lay.volunteer_objects(2, 2, 2),
                                                                      lay.volunteer_objects(2, 2, 1)))


def test_pruning_costs_what_the_model_says(round_on_s3):
    _, lay, steps = round_on_s3
    # and round 0 out of the volunteers' prefixes: all they hold (heartbeats, shards, manifests)
    round0 = lay.volunteer_objects(shards=2, peers=2, rounds=1)
    _close(steps["prune state 1"], lay.prune_state(shards=2, peers=2) + lay.prune_volunteers(round0, round0))
    # states 2-4: state 2 (round 1's) goes, 3 and 4 were never made; the prefixes empty
    _close(steps["prune again"], lay.prune_state(shards=2, peers=2) + lay.prune_missing() * 2
           + lay.prune_volunteers(0, 0))


def test_the_cadence_is_integrated_over_the_falling_eta():
    """A round open 100 s with the default cadence: polls every 0.5 s below an ETA of 1 s, at
    half the ETA up to 40 s, every 20 s above."""
    cad = RunConfig(run="x").cadence
    want = 1 / 0.5 + np.log(40 / 1) / 0.5 + 60 / 20
    assert _count(cad.poll_s, 100.0) == pytest.approx(want, rel=1e-3)
    assert _count(cad.poll_s, 1.0) == pytest.approx(2.0, rel=1e-3) and _count(cad.poll_s, 0) == 0


def test_a_planned_round_adds_up_from_its_parts():
    cfg = recipe_config("plan", "sahajbert")
    e = estimate(cfg, peers=40, days=14, samples_per_s=1.0, reduce_s=10.0, uplink_mbit_s=100.0)
    lay = Traffic(PlannedRun(cfg))
    assert e.n_params == 18_105_474 and e.chunks == 18 and e.round_s == pytest.approx(4096 / 40)
    upload_s = 0.66 * e.n_params * 8 / 100e6
    assert e.settle_s == pytest.approx(10.0 + upload_s) and e.open_s == pytest.approx(e.round_s - e.settle_s)
    per_round = {k: v * e.round_s / 3600 for k, v in e.volunteer_hour.requests.items()}
    assert per_round["get"] == pytest.approx(e.view_reads_per_round + lay.state_download().get + lay.shard_upload().get)
    assert per_round["put"] == pytest.approx(e.heartbeats_per_round + lay.shard_upload().put)
    assert per_round.get("head", 0) == 0  # no HEAD of the next COMMIT while the round is reduced
    assert per_round["list"] == 0
    down = e.volunteer_hour.bytes_down * e.round_s / 3600
    assert 0.47 * e.n_params < down < 0.48 * e.n_params  # the delta, and small objects
    s3 = e.cost["s3"]
    assert s3.run == pytest.approx(40 * 14 * s3.volunteer_day.total + 14 * s3.scheduler_day.total + s3.storage)
    assert e.cost["r2"].volunteer_day.egress == 0 and s3.volunteer_day.egress > 0
    inside = estimate(cfg, 40, 14, 1.0, reduce_s=10.0, uplink_mbit_s=100.0, scheduler_egress=False)
    assert inside.cost["s3"].scheduler_day.egress == 0 < s3.scheduler_day.egress


def test_volunteer_aggregators_take_the_state_off_the_organizers_machine():
    """With 4 volunteer aggregators (two to a part) the organizer reads of the shards and the
    state only what its audits recompute (an eighth of each part: a chunk of 8) and writes
    records; each aggregator reads half the parts of every shard and of the fp32 state (LAMB:
    params, two slots, the int4 delta's residual) and writes them back with the delta. One
    aggregator is no check: refused."""
    from dedloc_pipeline.planning.estimate import DELTA_BYTES_PER_PARAM, DENSE_BYTES_PER_PARAM, SHARD_BYTES_PER_PARAM
    cfg = recipe_config("plan", "sahajbert", chunk_size=1 << 17, chunks_per_part=8)
    kw = dict(peers=40, days=14, samples_per_s=1.0, reduce_s=10.0, uplink_mbit_s=100.0)
    alone, helped = estimate(cfg, **kw), estimate(cfg, **kw, aggregators=4)
    n, per_round = helped.n_params, helped.round_s / 3600
    shards, dense = 40 * SHARD_BYTES_PER_PARAM["int8"] * n, DENSE_BYTES_PER_PARAM * n
    agg = helped.aggregator_hour
    assert agg.bytes_down * per_round == pytest.approx(0.5 * (shards + 4 * dense))
    assert agg.bytes_up * per_round == pytest.approx(0.5 * (4 * dense + DELTA_BYTES_PER_PARAM["int4"] * n))
    saved = (alone.scheduler_hour.bytes_down - helped.scheduler_hour.bytes_down) * per_round
    # the validation's and the reduction's reads of the shards, and the state's: the organizer's three
    # dense reads a round with LAMB (the parameters and slots for the partial sums: the step takes the
    # gradient and state it wrote, vector.Kept); less the audits' of a chunk a part: the shards in each
    # of the three exchanges, the parameters and slots for the sums, and for the answers those, the
    # residual and the answer's objects
    audited = helped.audited_chunks / helped.chunks
    assert helped.audited_chunks == len(range(0, helped.chunks, 8)) and helped.audit_survival == 7 / 8
    audits = audited * (3 * shards + 3 * dense + (4 + 4) * dense + DELTA_BYTES_PER_PARAM["int4"] * n)
    assert saved == pytest.approx(2 * shards + 3 * dense - audits)
    assert audits < 0.25 * (2 * shards + 3 * dense)
    assert helped.scheduler_hour.bytes_up < alone.scheduler_hour.bytes_up / 1000
    s3 = helped.cost["s3"]
    assert s3.run == pytest.approx(40 * 14 * s3.volunteer_day.total + 14 * s3.scheduler_day.total
                                   + 4 * 14 * s3.aggregator_day.total + s3.storage)
    assert alone.aggregator_hour is None and alone.cost["s3"].aggregator_day is None
    with pytest.raises(ValueError, match="two to a part"):
        estimate(cfg, **kw, aggregators=1)
    out = CliRunner().invoke(app, ["cost", "--peers", "40", "--days", "14", "--preset", "sahajbert",
                                   "--samples-per-s", "1", "--aggregators", "4"])
    assert out.exit_code == 0 and "each of 4 volunteer aggregators" in out.output


def test_requests_per_volunteer_stay_flat_in_the_number_of_peers():
    """The cadence's point: more peers make shorter rounds, not more polls per hour."""
    cfg = recipe_config("plan", "sahajbert")
    few, many = (estimate(cfg, p, 1, 1.0, reduce_s=0.0).volunteer_hour.requests for p in (20, 40))
    assert many["get"] < 2 * few["get"]


def test_a_plan_needs_a_speed_where_none_was_measured():
    with pytest.raises(ValueError, match="no measured speed for preset 'sahajbert'"):
        estimate(recipe_config("p", "sahajbert"), 40, 14)
    assert estimate(recipe_config("p", "tiny"), 4, 1).samples_per_s == SAMPLES_PER_S["tiny"]


# the command

def cli(*args):
    return CliRunner().invoke(app, ["cost", *args])


def test_the_cost_command_prints_the_table():
    res = cli("--preset", "sahajbert", "--peers", "40", "--days", "14", "--samples-per-s", "1")
    assert res.exit_code == 0, res.output
    for text in ("per volunteer-hour", "GB per volunteer-day", "$ per volunteer-day", "whole run",
                 "scheduler", "S3", "R2", "18,105,474", "2026-12-01"):
        assert text in res.output, text
    as_json = cli("--preset", "tiny", "--peers", "4", "--days", "1", "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.output)["cost"]["s3"]["run"] > 0


def test_the_cost_command_reads_a_runs_config(tmp_path):
    from dedloc_pipeline.storage.bucket import Bucket
    url = f"file://{tmp_path}/b"
    init_run(Bucket(url), recipe_config("r", "tiny", target_batch_size=64))
    res = cli("--bucket", url, "--run", "r", "--peers", "4", "--days", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["target"] == 64
    res = cli("--bucket", url, "--run", "r", "--preset", "small", "--peers", "4", "--days", "2")
    assert res.exit_code == 2 and "drop --preset" in res.stderr


def test_the_cost_command_takes_a_price_file_and_refuses_a_bad_one(tmp_path):
    good = _dump(tmp_path, _priced())
    res = cli("--preset", "tiny", "--peers", "4", "--days", "1", "--prices", good)
    assert res.exit_code == 0 and "CHEAP" in res.output and "R2" not in res.output, res.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"date": "soon"}')
    res = cli("--preset", "tiny", "--peers", "4", "--days", "1", "--prices", str(bad))
    assert res.exit_code == 2 and res.stderr.startswith("error: prices "), res.output
    res = cli("--preset", "sahajbert", "--peers", "4", "--days", "1")
    assert res.exit_code == 2 and "no measured speed" in res.stderr


@pytest.mark.parametrize("preset", ["causal-1b", "causal-7b"])
def test_the_cost_command_prices_the_sparse_recipes(preset):
    """The 1B and 7B recipes (diloco, sparse shards and deltas) at benchmark 9's bytes per parameter."""
    res = cli("--preset", preset, "--peers", "40", "--days", "14", "--samples-per-s", "1", "--json")
    assert res.exit_code == 0, res.output
    e = json.loads(res.output)
    n, per_round = e["n_params"], e["round_s"] / 3600
    assert n == n_params(preset)
    assert 0.031 * n < e["volunteer_hour"]["bytes_up"] * per_round < 0.032 * n  # a shard, its manifest, heartbeats
    assert 0.035 * n < e["volunteer_hour"]["bytes_down"] * per_round < 0.036 * n  # a delta, views, a COMMIT


def test_the_cost_command_lists_every_preset():
    from dedloc_pipeline.model.presets import PRESETS
    res = CliRunner().invoke(app, ["cost", "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and " | ".join(PRESETS) in res.output, res.output


def test_the_organizers_cost_example_is_what_the_command_says():
    """docs/organizer.md quotes `dedloc cost` for a sahajBERT run: its figures are the command's
    (the report found them stale)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "organizer.md").read_text()
    args = "--preset sahajbert --peers 40 --days 14 --samples-per-s 1"
    assert f".venv/bin/dedloc cost {args}" in doc
    res = CliRunner().invoke(app, ["cost", *args.split()], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    row = {" ".join(line.split()[:-2]): line.split()[-2:] for line in res.output.splitlines()
           if line.startswith((" $", " scheduler's share"))}
    day, requests = row["$ per volunteer-day"], row["$ per volunteer-day, requests"]
    whole, share = row["$ whole run (40 volunteers × 14 days, egress included)"], row["scheduler's share"]
    quoted = " ".join(doc.split())
    assert (f"a volunteer costs ${float(day[0]):.2f} a day on S3 (${float(requests[0]):.2f} of it requests, the rest "
            f"egress of the deltas) and ${float(day[1]):.2f} on R2") in quoted
    assert f"outside it, {share[0]} of the S3 run's ${float(whole[0].replace(',', '')):,.0f})" in quoted
