"""The command line: `dedloc status` against the COMMIT markers, `init`'s options as RunConfig's fields, and how
every failure is reported."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import reduce
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, get_args, get_origin

import pytest
import torch
from typer.testing import CliRunner

from dedloc_pipeline.cli import app, common as cli_common, init_options, organizer as cli_organizer
from dedloc_pipeline.model.presets import PRESETS
from dedloc_pipeline.organizer.scheduler import Scheduler
from dedloc_pipeline.protocol.config import RECIPES, RunConfig, recipe_config
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.trust import identity
from dedloc_pipeline.volunteer.worker import Worker

from .conftest import small_config

ROUNDS = 3
MICRO = {"p0": 4, "p1": 8}  # different micro-batches, so the peers' sample counts differ
DEDLOC = os.path.join(os.path.dirname(sys.executable), "dedloc")
README = Path(__file__).resolve().parent.parent / "README.md"


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def error_line(result) -> str:
    """The failure is one line on stderr, starting with ``error:``; returns it."""
    assert result.exit_code != 0, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with ROUNDS committed rounds from two in-process peers, a fresh heartbeat each in the
    open round, and the scheduler's round view of them. Returns (bucket URL, Run, pending samples
    per peer)."""
    url = f"file://{tmp_path_factory.mktemp('cli')}/bucket"
    run = init_run(Bucket(url), small_config("cli-run"))
    workers = [Worker(run, p, micro_batch=mb, threads=1, poll_s=0) for p, mb in MICRO.items()]
    sched = Scheduler(run, 2, 0)
    deadline = time.monotonic() + 120
    with ThreadPoolExecutor(2) as pool:
        while run.latest() < ROUNDS:
            assert time.monotonic() < deadline, "the in-process run did not reach its rounds"
            for w in workers:
                w.sync()
                w.step()
                w.flush()
            sched.step(pool)
    assert run.latest() == ROUNDS
    # one micro-batch each in the open round: live progress, too little to upload (4 + 8 < 24)
    for w in workers:
        w.sync()
        w.step()
        w.flush()
    pending = {w.peer: w.acc.samples for w in workers}
    assert all(w.acc.round == ROUNDS for w in workers) and sum(pending.values()) < 24
    assert sched.try_close(ROUNDS) is None  # the view: what status reads of the open round
    return url, run, pending


# status --json

def test_status_json_matches_commit_markers(trained):
    url, run, pending = trained
    res = cli("status", "--bucket", url, "--run", run.name, "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)  # one JSON object, nothing else on stdout

    assert {"run", "round", "target_batch_size", "progress", "peers", "history"} <= s.keys()
    assert s["run"] == "cli-run"
    assert s["round"] == run.latest() == ROUNDS
    assert s["target_batch_size"] == 24

    # the open round: heartbeats of both peers, nothing uploaded yet
    assert s["progress"]["peers"] == len(MICRO)
    assert s["progress"]["samples"] == sum(pending.values())

    # the ledger: one entry per closed round, equal to its COMMIT
    commits = [run.commit_of(r) for r in range(1, ROUNDS + 1)]
    assert [h["round"] for h in s["history"]] == list(range(ROUNDS))
    for h, c in zip(s["history"], commits):
        assert {"round", "samples", "contributors", "loss", "committed_at"} <= h.keys()
        assert h["round"] == c["round"]
        assert h["samples"] == c["samples"] >= 24
        assert h["contributors"] == c["contributors"] and h["contributors"]
        assert h["loss"] == pytest.approx(c["loss"]) and isinstance(h["loss"], float)
        assert h["committed_at"] == pytest.approx(c["committed_at"])
        assert h["samples"] == sum(sh["samples"] for sh in c["shards"])

    # peers: what each contributed, summed over the COMMITs
    peers = {p["peer_id"]: p for p in s["peers"]}
    assert set(peers) == set(MICRO)
    for p in s["peers"]:
        assert {"peer_id", "samples", "rounds", "last_seen"} <= p.keys()
        mine = [sh for c in commits for sh in c["shards"] if sh["peer"] == p["peer_id"]]
        assert p["samples"] == sum(sh["samples"] for sh in mine) > 0
        assert p["rounds"] == sum(p["peer_id"] in c["contributors"] for c in commits) > 0
        assert p["last_seen"] >= max(c["closed_at"] for c in commits if p["peer_id"] in c["contributors"])
        assert p["last_seen"] <= time.time()
    assert sum(p["samples"] for p in s["peers"]) == sum(h["samples"] for h in s["history"])
    assert peers["p0"]["samples"] != peers["p1"]["samples"] or peers["p0"]["rounds"] != peers["p1"]["rounds"]


def test_status_human_readable(trained):
    url, run, _ = trained
    res = cli("status", "--bucket", url, "--run", run.name)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert "cli-run" in lines[0]
    assert f"state {ROUNDS}" in lines[0] and f"round {ROUNDS}" in lines[0]
    assert f"/{run.config.target_batch_size}" in lines[0]
    for r in range(ROUNDS):
        c = run.commit_of(r + 1)
        line = next((ln for ln in lines if ln.split(":")[0].split() == ["round", str(r)]), None)
        assert line is not None, res.stdout
        assert f"{c['loss']:.4f}" in line and f"{c['samples']} samples" in line
    for peer in MICRO:
        assert any(peer in ln for ln in lines[1:]), res.stdout
    assert not res.stderr


# errors

@pytest.mark.parametrize("command", ["status", "worker", "aggregate"])
def test_unknown_run(trained, command):
    url, _, _ = trained
    line = error_line(cli(command, "--bucket", url, "--run", "no-such-run"))
    assert "no-such-run" in line


def test_unknown_run_in_empty_bucket(tmp_path):
    (tmp_path / "empty").mkdir()
    line = error_line(cli("status", "--bucket", f"file://{tmp_path}/empty", "--run", "r"))
    assert line == f"error: no run 'r' in file://{tmp_path}/empty (create it with `dedloc init`)"


@pytest.mark.parametrize("command,module,extra", [("plot", "matplotlib", "organizer"),
                                                   ("report", "matplotlib", "organizer"),
                                                   ("aggregator", "prefect", "organizer")])
def test_a_command_of_an_extra_on_a_volunteers_install_names_the_extra(trained, tmp_path, monkeypatch, command,
                                                                          module, extra):
    """A volunteer's install leaves the organizer's side out (pyproject.toml): its commands say
    which extra to add, in one line, not an import's traceback."""
    url, run, _ = trained
    for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.")] + \
            ["dedloc_pipeline.monitoring.plots", "dedloc_pipeline.monitoring.report", "flows.aggregators"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    args = {"aggregator": ["--timeout", "1"]}.get(command, ["--bucket", url, "--run", run.name,
                                                           "--out", str(tmp_path / "out")])
    line = error_line(cli(command, *args))
    assert line == (f"error: 'root {command}' needs {module}, of the {extra} extra, which a volunteer's install "
                    f"leaves out: pip install 'dedloc-pipeline[{extra}]'")


@pytest.mark.parametrize("args,line", [
    (["aggregate", "--parallel", "0"], "error: Invalid value for '--parallel': Input should be greater than or "
                                       "equal to 1 (see 'root aggregate --help')"),
    (["worker", "--until-round", "-5"], "error: Invalid value for '--until-round': Input should be greater than or "
                                        "equal to 0 (see 'root worker --help')"),
    (["worker", "--progress-every", "0"], "error: Invalid value for '--progress-every': Input should be greater than "
                                          "or equal to 0.5 (see 'root worker --help')"),
    (["plot", "--out", "{file}"], "error: --out {file} is a file: the figures are written into a folder"),
    (["worker", "--key", "{public}"], "error: {public8}... is a public key (what the organizer enrolls): give the file "
                                      "of your private key, made by `dedloc keygen --out FILE`"),
])
def test_common_mistakes_get_one_line_naming_them(trained, tmp_path, args, line):
    """Options out of range, a file where a folder goes, a public key where the private key's
    file goes: one line each, what is wrong and what to give instead (and `plot` overwrites nothing).
    (CliRunner names the program ``root``; the command line, ``dedloc``.)"""
    url, run, _ = trained
    (tmp_path / "taken.png").write_bytes(b"mine")
    public = cli("keygen", "--out", str(tmp_path / "k.pem")).output.split("public key: ")[1].strip()
    values = dict(file=str(tmp_path / "taken.png"), public=public, public8=public[:8])
    got = error_line(cli(args[0], "--bucket", url, "--run", run.name, *[a.format(**values) for a in args[1:]]))
    assert got == line.format(**values)
    assert (tmp_path / "taken.png").read_bytes() == b"mine"


def test_a_run_that_could_never_fill_is_refused(tmp_path):
    line = error_line(cli("init", "--bucket", str(tmp_path / "b"), "--run", "r", "--preset", "micro",
                          "--target-batch", "99999999999999999999"))
    assert line == "error: invalid value: --target-batch: Input should be less than or equal to 16777216"
    assert error_line(cli("cost", "--peers", "4", "--days", "1", "--preset", "micro")) == (
        "error: no measured speed for preset 'micro': give the volunteers' samples/s (--samples-per-s)")


def test_bad_peer_id(trained):
    url, run, _ = trained
    line = error_line(cli("worker", "--bucket", url, "--run", run.name, "--peer-id", "no spaces/please"))
    assert line == "error: peer id 'no spaces/please' must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


@pytest.mark.parametrize("args, line", [
    (["--device", "tpu"], "--device tpu: not a torch device (cpu, cuda, cuda:1, mps)"),
    (["--device", "meta"], "--device meta: this worker trains on cpu, cuda or mps"),
    (["--micro-batch", "-4"], "--micro-batch -4: at least 1"),
    (["--threads", "0"], "--threads 0: at least 1"),
    (["--poll", "-1"], "--poll -1.0: at least 0"),
])
def test_bad_worker_options_are_refused_before_it_starts(trained, args, line):
    """Each names the option and exits 2, before any model is built (the first report: a traceback,
    `not enough values to unpack`, and a worker that uploaded, then died of a negative sleep)."""
    url, run, _ = trained
    res = cli("worker", "--bucket", url, "--run", run.name, *args)
    assert res.exit_code == 2 and error_line(res) == f"error: {line}", res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_worker_on_a_missing_gpu(trained):
    url, run, _ = trained
    line = error_line(cli("worker", "--bucket", url, "--run", run.name, "--device", "cuda"))
    assert "no CUDA device" in line


@pytest.mark.parametrize("args, flag", [
    (["--codec", "bogus"], "--codec"),
    (["--target-batch", "0"], "--target-batch"),
    (["--micro-batch", "many"], "--micro-batch"),
    (["--lr", "0"], "--lr"),
    (["--peer-timeout", "-1"], "--peer-timeout"),
    (["--late-shards", "maybe"], "--late-shards"),
    (["--chunk-size", "5000"], "chunk_size"),
    (["--run", "bad name!"], "--run"),
    (["--run", "-leading-dash"], "--run"),
    (["--min-fraction", "2"], "--min-fraction"),
    (["--close-timeout", "0"], "--close-timeout"),
    (["--seq-len", "4"], "--seq-len"),
    (["--chunks-per-part", "0"], "--chunks-per-part"),
    (["--aggregation", "median"], "--aggregation"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--download-codec", "zip"], "--download-codec"),
    (["--algorithm", "local-sgd"], "--algorithm"),
    (["--inner-batch", "0"], "--inner-batch"),
    (["--outer-momentum", "1"], "--outer-momentum"),
])
def test_bad_init_values(tmp_path, args, flag):
    url = f"file://{tmp_path}/bucket"
    argv = ["init", "--bucket", url, "--run", "ok", "--seq-len", "32", "--chunk-size", "262144"]
    for i in range(0, len(args), 2):  # override, don't duplicate
        if args[i] in argv:
            j = argv.index(args[i])
            argv[j + 1] = args[i + 1]
        else:
            argv += args[i:i + 2]
    line = error_line(cli(*argv))
    assert flag in line
    assert Bucket(url).find("runs") == []  # nothing was written


def test_a_derived_field_is_named_by_the_flag_it_comes_from(tmp_path):
    """block_size is min(4096, chunk_size): its error names --chunk-size, as chunk_size's does."""
    line = error_line(cli("init", "--bucket", f"file://{tmp_path}/b", "--run", "r", "--chunk-size", "0"))
    assert line.count("--chunk-size: ") == 2 and "block_size" not in line


def test_missing_option():
    line = error_line(cli("status", "--run", "x"))
    assert "--bucket" in line


def test_init_is_idempotent_and_refuses_another_config(tmp_path):
    url = f"file://{tmp_path}/bucket"
    base = ["init", "--bucket", url, "--run", "twice", "--seq-len", "32", "--chunk-size", "262144",
            "--target-batch", "48", "--micro-batch", "4"]
    first = cli(*base)
    assert first.exit_code == 0, first.output
    assert "twice" in first.stdout
    bucket = Bucket(url)
    run = Run(bucket, "twice")
    commit0, config = run.commit_of(0), bucket.read_bytes(run.keys.config)

    again = cli(*base)  # same config: a no-op success
    assert again.exit_code == 0, again.output
    assert not again.stderr
    assert Run(bucket, "twice").commit_of(0) == commit0
    assert bucket.read_bytes(run.keys.config) == config

    other = base[:base.index("--target-batch")] + ["--target-batch", "64", "--micro-batch", "4"]
    line = error_line(cli(*other))
    assert "already exists" in line and "twice" in line
    assert bucket.read_bytes(run.keys.config) == config
    assert Run(bucket, "twice").config.target_batch_size == 48


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on close: nothing listens there


@pytest.mark.slow
def test_unreachable_bucket(tmp_path):
    """An S3 endpoint that refuses connections: a bounded wait (retries), then one error line."""
    port = _closed_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    env.pop("AWS_ENDPOINT_URL", None)
    t0 = time.monotonic()
    proc = subprocess.run([DEDLOC, "status", "--bucket", "s3://nowhere-bucket/x", "--run", "r",
                           "--endpoint-url", f"http://127.0.0.1:{port}"],
                          env=env, capture_output=True, text=True, timeout=150)
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert not proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr  # retry warnings may precede it
    assert "Traceback" not in proc.stderr
    assert str(port) in errors[0] or "nowhere-bucket" in errors[0], errors[0]
    assert took < 120, f"gave up only after {took:.0f}s"


@pytest.mark.parametrize("url,line", [
    ("s3:collab", "error: bucket URL 's3:collab' is not one: s3://collab? (s3://BUCKET/PREFIX, a folder's path or "
                  "file://PATH, memory://NAME)"),
    ("s3:", "error: bucket URL 's3:' is not one: s3://BUCKET? (s3://BUCKET/PREFIX, a folder's path or file://PATH, "
            "memory://NAME)"),
    ("s3://", "error: bucket URL 's3://' names no bucket: s3://BUCKET/PREFIX"),
    ("colab/bucket", "error: no folder {cwd}/colab/bucket (a mistyped path? `dedloc init` makes a run's folder)")])
@pytest.mark.parametrize("command", ["status", "worker"])
def test_a_mistyped_bucket_is_named_and_nothing_is_created(tmp_path, monkeypatch, command, url, line):
    """A bucket URL that is not one, or a folder that is not there, is told in one line: never
    taken as the name of a local folder, never created (only `dedloc init` makes a run's folder)."""
    monkeypatch.chdir(tmp_path)
    assert error_line(cli(command, "--bucket", url, "--run", "r")) == line.format(cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_s3_mistakes_are_named_in_one_line(s3_bucket, monkeypatch, tmp_path):
    """On S3: a bucket that does not exist (for `status` and for `init`), no credentials at all,
    an AWS profile that is not there; each says what is wrong and what to do, never botocore's
    traceback."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    init_run(s3_bucket, small_config("here"))
    no_bucket = (f"error: no bucket 'nosuchbucket' at {endpoint}: a mistyped name, or --endpoint-url / "
                 "AWS_ENDPOINT_URL not the store's")
    assert error_line(cli("status", "--bucket", "s3://nosuchbucket/x", "--run", "here")) == no_bucket
    assert error_line(cli("init", "--bucket", "s3://nosuchbucket/x", "--run", "here", "--preset", "micro")) == no_bucket
    # no credentials anywhere (nor a shared file or a profile to find them in)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert error_line(cli("status", "--bucket", s3_bucket.url, "--run", "here")) == (
        f"error: no credentials for {s3_bucket.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the organizer "
        "gives them), or AWS_PROFILE")
    monkeypatch.setenv("AWS_PROFILE", "nosuch")
    assert error_line(cli("status", "--bucket", s3_bucket.url, "--run", "here")) == (
        f"error: bucket {s3_bucket.url}: The config profile (nosuch) could not be found (a profile of "
        "~/.aws/credentials or ~/.aws/config, as --write-profile, DEDLOC_WRITE_PROFILE or AWS_PROFILE name it)")


def test_init_on_a_data_set_then_eval_and_export(bengali, tmp_path):
    url, name = bengali
    res = cli("init", "--bucket", url, "--run", "cli-bn", "--data", name, "--seq-len", "32")
    assert res.exit_code == 0, res.output
    assert Run(Bucket(url), "cli-bn").config.data == name
    bad = cli("init", "--bucket", url, "--run", "cli-bad", "--data", name)  # tiny's default sequence is 128
    assert bad.exit_code == 2 and "error:" in bad.output and "sequence length 32" in bad.output
    res = cli("eval", "--bucket", url, "--run", "cli-bn", "--task", "mlm-heldout")
    assert res.exit_code == 0, res.output
    assert "mlm-heldout (bn-test held-out split): loss" in res.output and "random init" in res.output
    res = cli("export", "--bucket", url, "--run", "cli-bn", "--out", str(tmp_path / "hf"))
    assert res.exit_code == 0 and (tmp_path / "hf" / "tokenizer.json").exists(), res.output


def test_eval_of_a_synthetic_run_says_what_is_missing(tmp_path):
    url = f"file://{tmp_path}/b"
    init_run(Bucket(url), small_config("syn"))
    res = cli("eval", "--bucket", url, "--run", "syn", "--task", "ner")
    assert res.exit_code == 2 and "no tokenizer" in res.output
    res = cli("eval", "--bucket", url, "--run", "syn", "--task", "sentiment")
    assert res.exit_code == 2 and "unknown task" in res.output


def test_keys_enrolment_and_revocation(tmp_path):
    """The organizer's commands around a signed run, and what a volunteer sees."""
    b = f"file://{tmp_path}/b"
    org, vol = str(tmp_path / "org.pem"), str(tmp_path / "alice.pem")
    res = cli("keygen", "--out", org)
    assert res.exit_code == 0 and "public key: " in res.output
    assert "exists" in error_line(cli("keygen", "--out", org))  # never overwritten
    assert oct(os.stat(org).st_mode & 0o777) == "0o600"
    alice_pub = cli("keygen", "--out", vol).output.split("public key: ")[1].strip()
    init = ["init", "--bucket", b, "--run", "r", "--seq-len", "32", "--chunk-size", str(1 << 18)]
    assert cli(*init, "--organizer-key", org).exit_code == 0
    assert "organizer_key" in json.dumps(Bucket(b).read_json("runs/r/run.json"))
    worker = ["worker", "--bucket", b, "--run", "r", "--peer-id", "alice", "--until-round", "0", "--device", "cpu"]
    assert "pass --key" in error_line(cli(*worker))
    assert "nobody is enrolled" in error_line(cli(*worker, "--key", vol))
    assert "not the key" in error_line(cli("enroll", "--bucket", b, "--run", "r", "--organizer-key", vol,
                                           "--volunteer", "alice", "--public-key", alice_pub))
    assert "not an Ed25519 public key" in error_line(cli("enroll", "--bucket", b, "--run", "r", "--organizer-key",
                                                         org, "--volunteer", "alice", "--public-key", "xyz"))
    private = open(vol).read()
    res = cli("enroll", "--bucket", b, "--run", "r", "--organizer-key", org, "--volunteer", "alice",
              "--public-key", private)
    assert "that is a private key (not shown)" in error_line(res) and "PRIVATE" not in res.output
    assert private.splitlines()[1] not in res.output  # never echoed
    enroll = ["enroll", "--bucket", b, "--run", "r", "--organizer-key", org]
    assert "must match" in error_line(cli(*enroll, "--volunteer", "bob/x", "--public-key", alice_pub))
    res = cli(*enroll, "--volunteer", "alice", "--public-key", alice_pub)
    assert res.exit_code == 0 and "version 1" in res.output
    other = cli("keygen", "--out", str(tmp_path / "other.pem")).output.split("public key: ")[1].strip()
    assert "enrolled with another key: pass --replace" in error_line(
        cli(*enroll, "--volunteer", "alice", "--public-key", other))
    assert cli(*enroll, "--volunteer", "alice", "--public-key", alice_pub).exit_code == 0  # the same key: fine
    assert cli(*worker, "--key", vol).exit_code == 0
    res = cli("revoke", "--bucket", b, "--run", "r", "--organizer-key", org, "--volunteer", "alice")
    assert res.exit_code == 0 and "version 3" in res.output
    assert "revoked" in error_line(cli(*worker, "--key", vol))
    cli("init", "--bucket", b, "--run", "open", "--seq-len", "32", "--chunk-size", str(1 << 18))
    assert "without --organizer-key" in error_line(cli("revoke", "--bucket", b, "--run", "open", "--organizer-key",
                                                       org, "--volunteer", "alice"))


def test_policy_prints_a_volunteers_rights():
    res = cli("policy", "--bucket", "s3://collab/sahajbert", "--run", "demo", "--peer", "alice")
    doc = json.loads(res.output)
    puts = [s for s in doc["Statement"] if s["Effect"] == "Allow" and "s3:PutObject" in str(s["Action"])]
    assert [s["Resource"] for s in puts] == ["arn:aws:s3:::collab/sahajbert/runs/demo/volunteers/alice/*"]
    assert "peer id" in error_line(cli("policy", "--bucket", "s3://collab/x", "--run", "demo", "--peer", "a*"))


# init's options are RunConfig's fields

# every spelling the README, the tests and the flows use
HISTORICAL = ["--preset", "--target-batch", "--data", "--micro-batch", "--codec", "--download-codec", "--optimizer",
              "--lr", "--seed", "--seq-len", "--chunk-size", "--chunks-per-part", "--close-timeout",
              "--min-fraction", "--late-shards", "--delayed-updates", "--peer-timeout", "--organizer-key",
              "--aggregation"]
RECIPE_FIELDS = {k for r in RECIPES.values() for k, v in r.items() if not isinstance(v, dict)} | {
    f"{k}.{leaf}" for r in RECIPES.values() for k, v in r.items() if isinstance(v, dict) for leaf in v}


def _field(path):
    model, *inner, leaf = RunConfig, *path.split(".")
    for name in inner:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf]


def _value(cfg, path):
    return reduce(getattr, path.split("."), cfg)


def test_init_help_shows_each_fields_flag_choices_default_and_description():
    res = CliRunner().invoke(app, ["init", "--help"], env={"COLUMNS": "400"})  # one line per option
    assert res.exit_code == 0, res.output
    lines = {ln.split()[1]: ln for ln in res.stdout.splitlines() if ln.startswith("│ --")}
    flags = []
    for path in init_options.INIT_SETTINGS:
        field, leaf = _field(path), path.rpartition(".")[2]
        flag = (field.json_schema_extra or {}).get("flag") or "--" + leaf.replace("_", "-")
        flags.append(flag)
        line = lines[flag]
        annotation = field.annotation
        choices = next((a for a in (annotation, *get_args(annotation)) if get_origin(a) is Literal), None)
        if choices is not None:
            assert f"<{'|'.join(get_args(choices))}>" in line
        if path in RECIPE_FIELDS:
            by_preset = ", ".join(f"{p} {_value(recipe_config('x', p), path)}" for p in PRESETS)
            assert f"default: the preset's recipe ({by_preset})" in line and "[default:" not in line
        elif field.annotation is bool:
            assert f"[default: {flag[2:] if field.default else 'no-' + flag[2:]}]" in line
        elif field.default is not None:
            assert f"[default: {field.default}]" in line
        if path != "organizer_key":  # takes a key file, not the public key it stores
            assert field.description in line
    assert set(HISTORICAL) <= set(flags) and len(flags) == len(set(flags))
    assert "--no-delayed-updates" in lines["--delayed-updates"]


@pytest.fixture
def made(monkeypatch):
    """Runs `dedloc init ARGS` up to the config it would write; returns that config."""
    configs = []

    def init_run(bucket, cfg, organizer=None):
        configs.append(cfg)
        return SimpleNamespace(flat=SimpleNamespace(n=0))

    monkeypatch.setattr(cli_organizer, "init_run", init_run)

    def make(*args):
        res = cli("init", "--bucket", "memory://unused", "--run", "r", *args)
        assert res.exit_code == 0, res.output
        return configs.pop()
    return make


@pytest.mark.parametrize("preset", list(PRESETS))
def test_an_unset_option_is_the_presets_recipe(made, preset):
    assert made("--preset", preset) == recipe_config("r", preset)
    mine = made("--preset", preset, "--lr", "1e-3")  # the rest of the recipe stays
    assert mine.optimizer.lr == 1e-3
    assert mine.model_dump(exclude={"optimizer": {"lr"}}) == recipe_config("r", preset).model_dump(
        exclude={"optimizer": {"lr"}})


@pytest.mark.parametrize("args, fields", [
    (["--target-batch", "48"], {"target_batch_size": 48}),
    (["--data", "bn"], {"data": "bn"}),
    (["--micro-batch", "4"], {"micro_batch": 4}),
    (["--codec", "fp16"], {"codec": "fp16"}),
    (["--download-codec", "none"], {"download_codec": "none"}),
    (["--optimizer", "lamb"], {"optimizer.name": "lamb"}),
    (["--lr", "0.002"], {"optimizer.lr": 0.002}),
    (["--seed", "3"], {"seed": 3}),
    (["--seq-len", "64"], {"seq_len": 64}),
    (["--chunk-size", "262144"], {"chunk_size": 262144, "block_size": 4096}),
    (["--chunk-size", "2048"], {"chunk_size": 2048, "block_size": 2048}),  # one int8 block per chunk
    (["--chunks-per-part", "2"], {"chunks_per_part": 2}),
    (["--close-timeout", "30"], {"close.timeout_s": 30.0}),
    (["--min-fraction", "0.25"], {"close.min_fraction": 0.25}),
    (["--late-shards", "fold"], {"close.late_shards": "fold"}),
    (["--no-delayed-updates"], {"delayed_updates": False}),
    (["--peer-timeout", "4"], {"peer_timeout_s": 4.0}),
    (["--aggregation", "trimmed_mean"], {"aggregation": "trimmed_mean"}),
])
def test_each_option_sets_its_field(made, args, fields):
    """Each flag sets its field and nothing else (as recipe_config with that field given)."""
    given: dict = {}
    for path, value in fields.items():
        head, _, leaf = path.rpartition(".")
        (given.setdefault(head, {}) if head else given)[leaf] = value
    assert made(*args) == recipe_config("r", **given)


# one place reports every failure

@pytest.mark.parametrize("exc, code, line", [
    (cli_common.RunError("no run 'r' in the bucket"), 2, "error: no run 'r' in the bucket"),
    (cli_common.StorageError("the bucket said no"), 2, "error: the bucket said no"),
    (ValueError("a bad value"), 2, "error: a bad value"),
    (PermissionError("access denied"), 2, "error: access denied"),
    (FileNotFoundError("nothing at k"), 2, "error: nothing at k"),
    (RuntimeError("a bug\nover two lines"), 1, "error: RuntimeError: a bug over two lines"),
])
def test_every_command_reports_errors_in_one_line(monkeypatch, exc, code, line):
    def fail(*_, **__):
        raise exc
    monkeypatch.setattr(cli_common, "Run", fail)
    for command in (["status"], ["stop"], ["export", "--out", "x"], ["report", "--out", "x"]):
        res = cli(*command, "--bucket", "memory://b", "--run", "r")
        assert res.exit_code == code and error_line(res) == line, (command, res.output)


def test_ctrl_c_exits_130_quietly(monkeypatch):
    def interrupted(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_common, "Run", interrupted)
    res = cli("aggregate", "--bucket", "memory://b", "--run", "r")
    assert res.exit_code == 130 and not res.stderr.strip()


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_sigterm_and_sighup_are_taken_as_ctrl_c(monkeypatch, sig, code):
    """What systemd, docker and a closed terminal send interrupts a command as Ctrl-C does (the
    scheduler publishes that it ended, the validator stops between rounds) and exits 128 + it."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in previous:  # as a process started from a terminal has them (not under nohup: ignored stays ignored)
        signal.signal(s, signal.SIG_DFL)

    def signalled(*_, **__):
        signal.raise_signal(getattr(signal, sig))
        raise AssertionError("the signal did not interrupt")
    monkeypatch.setattr(cli_common, "Run", signalled)
    try:
        res = cli("aggregate", "--bucket", "memory://b", "--run", "r")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert res.exit_code == code and not res.stderr.strip(), res.output


def test_a_stop_signal_taken_inside_a_finalizer_is_not_lost(monkeypatch):
    """A signal can arrive while the garbage collector runs some object's ``__del__``, where a
    raised exception is printed and ignored: a SIGTERM once left a `dedloc aggregate` running that
    way (CI, test_lease). The handler sends it again a moment later, and it interrupts then.
    Control: raised inside the finalizer, the same exception is swallowed."""
    from dedloc_pipeline.monitoring import stop

    class Dies:
        def __init__(self, then):
            self.then = then

        def __del__(self):
            self.then()

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(type(u.exc_value)))
    Dies(lambda: stop._interrupt(signal.SIGTERM, None))  # the control: raised there (no frame to tell)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop._interrupt)
    try:
        with pytest.raises(stop.Interrupted) as caught:
            Dies(lambda: signal.raise_signal(signal.SIGTERM))  # collected at once: taken in its __del__
            threading.Event().wait(30)  # interrupted when the signal comes again
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert caught.value.signum == signal.SIGTERM and swallowed == [stop.Interrupted]


def test_damaged_records_are_named_by_their_key(tmp_path):
    """A truncated COMMIT.json, a run.json with a bad field or without its layout version, a
    bucket URL whose protocol is not installed: one line naming the object or field at fault
    (the first report: `Unterminated string starting at: line 15 column 4`, `invalid value:
    --target-batch` from commands that took no such flag, `bucket layout vNone`)."""
    b = f"file://{tmp_path}/b"
    run = init_run(Bucket(b), small_config("r"))
    status = ["status", "--bucket", b, "--run", "r"]
    commit = run.keys.commit(0)
    good = run.bucket.read_bytes(commit)
    run.bucket.write_bytes(commit, good[: len(good) // 2])
    line = error_line(cli(*status))
    assert line.startswith(f"error: {b}/{commit} is damaged: not JSON"), line
    run.bucket.write_bytes(commit, good)
    config = run.bucket.read_json(run.keys.config)
    run.bucket.write_json(run.keys.config, dict(config, target_batch_size=-3))
    line = error_line(cli(*status))
    assert f"{b}/{run.keys.config} is invalid: target_batch_size: Input should be greater than 0" in line, line
    assert "--target-batch" not in line
    run.bucket.write_json(run.keys.config, {k: v for k, v in config.items() if k != "layout_version"})
    assert "has no layout_version: not a dedloc run, or damaged" in error_line(cli(*status))
    line = error_line(cli("status", "--bucket", "gs://somewhere/runs", "--run", "r"))
    assert line.startswith("error: bucket gs://somewhere/runs: gs:// is not usable here"), line


def test_a_signal_ignored_at_start_stays_ignored():
    """Under ``nohup`` SIGHUP is ignored, and so it stays: the user asked for it."""
    from dedloc_pipeline.monitoring import stop

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop.as_interrupt()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def _shown(block: str) -> list[list[str]]:
    """The ``dedloc`` command lines of a shell block, as the README shows them: continuation lines
    joined, comments dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(ln, comments=True)[1:] for ln in lines if re.match(r"\s*(\.venv/bin/)?dedloc ", ln)]


@pytest.mark.slow
def test_the_readmes_commands_run_as_shown(tmp_path, s3_bucket):
    """The README's two walk-throughs, a volunteer's (keygen, worker) and an organizer's (keygen,
    init with sahajBERT's recipe, enroll, policy, aggregate, status), each command as printed, on
    moto's S3 server: only the bucket, the key files' folder and the volunteer's public key are
    put in, and the two long-running roles are bounded (``--until-round 0``). docs/volunteer.md
    shows the same signed join, and a join of an open run, run here on one."""
    blocks = BASH.findall(README.read_text())
    volunteer = next(_shown(b) for b in blocks if "dedloc worker" in b)
    organizer = next(_shown(b) for b in blocks if "dedloc init" in b)
    guide = [_shown(b) for b in BASH.findall((README.parent / "docs" / "volunteer.md").read_text())]
    assert guide[1:] == [volunteer] and [c[0] for c in guide[0]] == ["worker"]
    assert [c[0] for c in volunteer] == ["keygen", "worker"]
    assert [c[0] for c in organizer] == ["keygen", "init", "enroll", "policy", "aggregate", "status"]
    home = str(tmp_path)
    put_in = {"s3://collab-bucket/prefix": s3_bucket.url, "s3://collab/sahajbert": s3_bucket.url,
              "~/.dedloc/": f"{home}/", "organizer.pem": f"{home}/organizer.pem"}

    def run(args: list[str]) -> str:
        args = [reduce(lambda a, kv: a.replace(*kv), put_in.items(), x) for x in args]
        args += ["--until-round", "0"] if args[0] in ("worker", "aggregate") else []
        res = cli(*args)
        assert res.exit_code == 0, (args, res.output)
        return res.output

    alice = run(volunteer[0])
    put_in["KEY"] = re.search(r"public key: (\S+)", alice).group(1)
    out = [run(c) for c in organizer]
    assert "alice" in out[3] and s3_bucket.url.split("/")[2] in out[3]  # her write prefix, as an S3 policy
    assert "state 0" in out[5]
    assert "stopped at state 0" in run(volunteer[1])
    put_in["s3://collab-bucket/prefix"] = f"{s3_bucket.url}-open"  # an open run of the same name
    init_run(Bucket(put_in["s3://collab-bucket/prefix"]), small_config("sahajbert"))
    assert "stopped at state 0" in run(guide[0][0])
    run_ = Run(Bucket(s3_bucket.url), "sahajbert")
    roster = identity.newest_roster(run_.bucket, run_.name, run_.config.organizer_key)
    assert run_.config.preset == "sahajbert" and run_.latest() == 0 and roster.volunteers["alice"] == put_in["KEY"]


@pytest.mark.slow
def test_the_readmes_data_set_command_runs_as_shown(tmp_path, s3_bucket):
    """The README's `dedloc data make`, as printed, on moto's S3 server: only the bucket and the
    corpus's folder put in (a few hundred documents of the embedded corpus, as JSON lines)."""
    [block] = [b for b in BASH.findall(README.read_text()) if "dedloc data make" in b]
    [args] = _shown(block)
    lines = (README.parent / ".dedloc" / "corpus" / "shobdo.txt").read_text(encoding="utf-8").splitlines()[:3600]
    folder = tmp_path / "bengali-corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 12])}, ensure_ascii=False)
                                            + "\n" for i in range(0, len(lines), 12)), encoding="utf-8")
    put_in = {"~/bengali-corpus/": f"{folder}/", "s3://collab/sahajbert": s3_bucket.url}
    res = cli(*[reduce(lambda a, kv: a.replace(*kv), put_in.items(), x) for x in args])
    assert res.exit_code == 0, res.output
    card = s3_bucket.read_json("data/bengali/DATA.json")
    assert card["seq_len"] == 512 and card["documents"] == 300
    assert card["sources"]["sources"][0]["licence"] == "CC BY-SA 4.0"
    assert "300 documents" in res.output
    # the corpus in the bucket too, by its s3:// URL: the same data set
    s3_bucket.write_bytes("corpus/a.jsonl", (folder / "a.jsonl").read_bytes())
    put_in["~/bengali-corpus/"] = f"{s3_bucket.url}/corpus/"
    args = [reduce(lambda a, kv: a.replace(*kv), put_in.items(), x) for x in args]
    res = cli(*[a if a != "bengali" else "from-s3" for a in args])
    assert res.exit_code == 0, res.output
    again = s3_bucket.read_json("data/from-s3/DATA.json")
    def unnamed(splits: dict) -> str:  # the shards' keys hold the data set's name and recipe
        return re.sub(r"data/[\w-]+/(\w+)/[0-9a-f]{16}-", r"\1/", json.dumps(splits))
    assert unnamed(again["splits"]) == unnamed(card["splits"])
