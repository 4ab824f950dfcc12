"""Least-privilege volunteer credentials (dedloc_pipeline/policy.py), against a bucket that enforces them.

A separate moto server is started here with IAM enforcement on (``INITIAL_NO_AUTH_ACTION_COUNT``:
moto serves that many requests unauthenticated, then checks every request's signature and
the caller's IAM policies). The first requests create an admin user; the admin creates the
bucket, the run, and a volunteer user with the generated policy as its inline policy
(``put_user_policy``); the volunteer's requests are then signed with its own keys.

What moto (5.2) enforces, and so what these tests prove: the request's signature and access
key; the policy's grammar (``put_user_policy`` rejects malformed documents); ``Action`` and
``Resource`` with ``*`` wildcards; explicit ``Deny`` over ``Allow``; the default deny (so
deletes, other peers' keys, the organizer's markers and other buckets are refused).

What moto does not enforce, and how it is covered instead:
- ``Condition`` with ``StringLike`` (moto evaluates only ``StringEquals``): the ``s3:prefix``
  restriction of ListBucket is not checked by the server. ``test_a_real_worker_...`` records
  every listing prefix the real worker sends and checks each one against the policy's
  ``s3:prefix`` patterns, so a worker would not be refused on AWS or MinIO for listing.
- STS session policies (moto's assumed-role credentials carry only the role's policies), so
  the ``aws sts assume-role --policy`` route is exercised through the same document attached
  to an IAM user.
- S3's 403-instead-of-404 for a missing key when the caller may not list (moto answers 404 to
  anyone allowed GetObject). docs/security.md has the check to run once on a real bucket.
- Cloudflare R2's temporary credentials (not emulated): the request body is unit-tested.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.protocol.worker import Worker
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import DataLayout, RunLayout
from dedloc_pipeline.trust import policy
from .conftest import _free_port, small_config

PREFIX = "collab"
RUN = "least"
ME, OTHER = "alice", "bob"
REGION = "us-east-1"
ROUNDS = [0, 5, 12345678]
PART = "0001700000000-abcdef"  # as worker._upload names a part
BOOTSTRAP = 3  # unauthenticated requests: create the admin user, its policy, its access key


def _iam_match(pattern: str, key: str) -> bool:
    """IAM's wildcard matching: '*' any run of characters ('/' included)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), key) is not None


def _may_write(k: policy.VolunteerKeys, key: str) -> bool:
    return any(_iam_match(p, key) for p in k.writes) and not any(_iam_match(p, key) for p in k.deny_writes)


# ---------------------------------------------------------------------------------------------
# the layout: every key RunLayout can produce is writable by the volunteer only where it should be


# RunLayout's methods that take a key apart rather than make one
PARSERS = {"round_of", "shard_parts", "shard_holding", "peer_of_progress", "state_number", "block_of"}


def _layout_keys(keys: RunLayout) -> list[tuple[str, str]]:
    """(description, key) for every method and property of RunLayout, called with a few rounds,
    both peers, and parts; a method with a parameter this test does not know fails the test,
    so a new kind of key cannot slip past it."""
    shard = {p: keys.shard(5, p, PART) for p in (ME, OTHER)}
    values = {
        "r": ROUNDS, "s": ROUNDS, "peer": [ME, OTHER], "name": ["m", "v"], "task": ["ner"], "block": [0, 42],
        "shard": list(shard.values()), "manifest": [keys.manifest(s) for s in shard.values()],
    }
    out = []
    for name, attr in inspect.getmembers(RunLayout):
        if name.startswith("_"):
            continue
        if isinstance(attr, property):
            out.append((name, getattr(keys, name)))
            continue
        if not callable(attr) or name in PARSERS:
            continue
        params = list(inspect.signature(attr).parameters.values())[1:]
        combos: list[dict] = [{}]
        for p in params:
            if p.name == "part":
                choices = [3] if p.annotation in ("int", int) else [PART]
            elif p.name in values:
                choices = values[p.name]
            else:
                pytest.fail(f"RunLayout.{name} takes {p.name!r}: teach test_policy which values it has "
                            "and whether a volunteer writes those keys")
            combos = [dict(c, **{p.name: v}) for c in combos for v in choices]
        for c in combos:
            made = getattr(keys, name)(**c)
            out.extend((f"{name}({c})", key) for key in ((made,) if isinstance(made, str) else made))
    return out


def _volunteer_writes(keys: RunLayout) -> set[str]:
    """The keys the code has a volunteer write (worker.py: heartbeats; shard.py: a shard's folder,
    whose chunks lie below it, and its manifest; data.py: claims)."""
    out = {keys.claim(0), keys.claim(42)}
    for r in ROUNDS:
        own = keys.shard(r, ME, PART)
        out |= {own, keys.manifest(own), keys.progress(r, ME)}
    return out


@pytest.mark.parametrize("prefix", ["", PREFIX, "a/b.c"])
def test_only_the_volunteers_own_keys_are_writable(prefix):
    k = policy.volunteer_keys(prefix, RUN, ME)
    keys = RunLayout(RUN)
    mine = _volunteer_writes(keys)
    join = (lambda key: f"{prefix}/{key}") if prefix else (lambda key: key)
    checked = 0
    for what, key in _layout_keys(keys):
        want = key in mine
        assert _may_write(k, join(key)) == want, f"{what}: {key}"
        checked += 1
    assert checked > 40
    own = keys.shard(5, ME, PART)
    for chunk in ("values/zarr.json", "values/c/0", "codes/c/12", "scales/zarr.json"):
        assert _may_write(k, join(f"{own}/{chunk}"))
    for key in (DataLayout("bn").card, DataLayout("bn").shard("train", 0), DataLayout("bn").unigram):
        assert not _may_write(k, join(key))
    # keys nested into another peer's folders, which the round's listings would pick up
    for key in (f"{keys.manifests_dir(5)}/{OTHER}/manifests/{ME}/x.json",
                f"{keys.shards_dir(5)}/{OTHER}/p/shards/{ME}/x",
                f"{keys.manifests_dir(5)}/{OTHER}/shards/{ME}/x",
                f"{keys.progress_dir(5)}/{OTHER}/progress/{ME}.json",
                f"{keys.round(5)}/reduced/shards/{ME}/x"):
        assert not _may_write(k, join(key)), key
    # another run, another prefix
    assert not _may_write(k, join(RunLayout("other").progress(5, ME)))
    assert not _may_write(k, f"elsewhere/{keys.progress(5, ME)}")


def test_reads_cover_the_run_and_the_data_only():
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    keys = RunLayout(RUN)
    for key in (keys.config, keys.commit(3), keys.params(3) + "/values/c/0", keys.close(3), keys.stop(),
                DataLayout("bn").card, DataLayout("bn").shard("train", 2)):
        assert any(_iam_match(p, f"{PREFIX}/{key}") for p in k.reads), key
    for key in (RunLayout("other").config, "secrets.txt"):
        assert not any(_iam_match(p, f"{PREFIX}/{key}") for p in k.reads), key
    narrowed = policy.volunteer_keys(PREFIX, RUN, ME, data="bn")
    assert any(_iam_match(p, f"{PREFIX}/{DataLayout('bn').card}") for p in narrowed.reads)
    assert not any(_iam_match(p, f"{PREFIX}/{DataLayout('other').card}") for p in narrowed.reads)


def test_the_aws_document():
    doc = policy.policy_for(f"s3://collab-bucket/{PREFIX}", RUN, ME, "aws")
    assert doc == policy.policy_for(f"s3://collab-bucket/{PREFIX}/", RUN, ME, "minio")
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["ListRunAndData"]["Resource"] == "arn:aws:s3:::collab-bucket"
    assert by_sid["ListRunAndData"]["Condition"] == {
        "StringLike": {"s3:prefix": [f"{PREFIX}/runs/{RUN}/*", f"{PREFIX}/data/*"]}}
    actions = {s["Action"] for s in doc["Statement"] if s["Effect"] == "Allow"}
    assert actions == {"s3:GetObject", "s3:ListBucket", "s3:PutObject"}  # no delete, no ACLs
    assert by_sid["NoKeysNestedInOtherFolders"]["Effect"] == "Deny"
    assert json.loads(json.dumps(doc)) == doc
    # IAM's limit for session policies and a user's inline policies is 2,048 characters
    assert len(json.dumps(doc, separators=(",", ":"))) < 1400
    gov = policy.aws_policy("collab-bucket", "", RUN, ME, partition="aws-us-gov")
    assert all(r.startswith("arn:aws-us-gov:s3:::collab-bucket") for s in gov["Statement"]
               for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]))


def test_the_r2_request_body():
    body = policy.policy_for("s3://collab-bucket/collab", RUN, ME, "r2", parent_access_key_id="abc123",
                             ttl_seconds=3600)
    assert body == {"bucket": "collab-bucket", "parentAccessKeyId": "abc123", "permission": "object-read-write",
                    "ttlSeconds": 3600, "prefixes": [f"collab/runs/{RUN}/", "collab/data/"]}
    keys = RunLayout(RUN)
    for key in _volunteer_writes(keys) | {keys.config, keys.stop()}:  # everything the worker touches
        assert any(f"collab/{key}".startswith(p) for p in body["prefixes"]), key
    assert not any(f"collab/{RunLayout(RUN + 'x').config}".startswith(p) for p in body["prefixes"])
    default = policy.policy_for("s3://collab-bucket", RUN, ME, "r2", data="bn")
    assert default["prefixes"] == [f"runs/{RUN}/", "data/bn/"]
    assert default["ttlSeconds"] == 86400 and default["parentAccessKeyId"] == policy.PARENT_KEY_PLACEHOLDER


@pytest.mark.parametrize("args, match", [
    (("file:///tmp/b", RUN, ME, "aws"), "s3://"),
    (("collab-bucket/x", RUN, ME, "aws"), "s3://"),
    (("s3://", RUN, ME, "aws"), "bucket ''"),
    (("s3://Collab/x", RUN, ME, "aws"), "S3 bucket name"),
    (("s3://ab/x", RUN, ME, "aws"), "S3 bucket name"),
    (("s3://a..b/x", RUN, ME, "aws"), "S3 bucket name"),
    (("s3://collab.bucket/x", RUN, ME, "r2"), "R2 bucket name"),
    (("s3://collab-bucket/a*", RUN, ME, "aws"), "segment 'a\\*'"),
    (("s3://collab-bucket/a//b", RUN, ME, "aws"), "segment ''"),
    (("s3://collab-bucket/a/../b", RUN, ME, "aws"), "segment '..'"),
    (("s3://collab-bucket/${aws:username}", RUN, ME, "aws"), "no '\\$'"),
    (("s3://collab-bucket/x", "run/x", ME, "aws"), "run 'run/x'"),
    (("s3://collab-bucket/x", "", ME, "aws"), "run ''"),
    (("s3://collab-bucket/x", RUN, "~heldout", "aws"), "peer id '~heldout'"),
    (("s3://collab-bucket/x", RUN, "a*", "aws"), "peer id 'a\\*'"),
    (("s3://collab-bucket/x", RUN, "x" * 65, "aws"), "peer id"),
    (("s3://collab-bucket/x", RUN, "bob\n", "aws"), "peer id 'bob.n' must match"),  # one full-match rule
    (("s3://collab-bucket/x", "run\n", ME, "aws"), "run 'run.n' must match"),
    (("s3://collab-bucket\n/x", RUN, ME, "aws"), "S3 bucket name"),
    (("s3://collab-bucket/x\n", RUN, ME, "aws"), "segment"),
    (("s3://collab-bucket/x", RUN, "manifests", "aws"), "reserved"),
    (("s3://collab-bucket/x", RUN, ME, "gcs"), "format 'gcs'"),
])
def test_inputs_are_validated(args, match):
    with pytest.raises(ValueError, match=match):
        policy.policy_for(*args)


def test_names_are_checked_with_one_full_match_rule_everywhere(tmp_path):
    from dedloc_pipeline.storage.layout import is_name
    from dedloc_pipeline.trust import identity
    assert is_name("bob") and is_name("bob.laptop-2") and not is_name("bob\n") and not is_name(None)
    org = identity.generate(tmp_path / "org.key")
    with pytest.raises(identity.IdentityError, match="must match"):
        identity.update_roster(Bucket(str(tmp_path / "b")), RUN, org,
                               enroll={"bob\n": identity.public(identity.generate(tmp_path / "bob.key"))})


def test_options_are_validated():
    with pytest.raises(ValueError, match="data set"):
        policy.policy_for("s3://collab-bucket", RUN, ME, "aws", data="../x")
    with pytest.raises(ValueError, match="partition"):
        policy.policy_for("s3://collab-bucket", RUN, ME, "aws", partition="gcp")
    for ttl in (0, policy.R2_MAX_TTL_S + 1, 1.5, True):
        with pytest.raises(ValueError, match="ttl_seconds"):
            policy.policy_for("s3://collab-bucket", RUN, ME, "r2", ttl_seconds=ttl)
    with pytest.raises(ValueError, match="parent_access_key_id"):
        policy.policy_for("s3://collab-bucket", RUN, ME, "r2", parent_access_key_id=" ")
    with pytest.raises(TypeError):
        policy.policy_for("s3://collab-bucket", RUN, ME, "aws", ttl_seconds=60)  # an r2-only option


# ---------------------------------------------------------------------------------------------
# a bucket that enforces the policy


def _client(service: str, endpoint: str, key: str = "bootstrap", secret: str = "bootstrap"):
    return boto3.client(service, endpoint_url=endpoint, region_name=REGION, aws_access_key_id=key,
                        aws_secret_access_key=secret,
                        config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}))


@pytest.fixture(scope="module")
def iam_server(tmp_path_factory):
    """A moto server of its own that authenticates and authorizes every request after BOOTSTRAP."""
    port = _free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(BOOTSTRAP), AWS_DEFAULT_REGION=REGION)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        env.pop(k, None)
    log = tmp_path_factory.mktemp("moto-iam") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.1)
        iam = _client("iam", endpoint)
        iam.create_user(UserName="organizer")
        iam.put_user_policy(UserName="organizer", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="organizer")["AccessKey"]
        yield {"endpoint": endpoint, "admin": (key["AccessKeyId"], key["SecretAccessKey"])}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def collab(iam_server):
    """The organizer's bucket with a run, a data object and a second bucket; the volunteer ME with
    the generated policy attached. Returns clients for both and the bucket names."""
    endpoint, (akey, asecret) = iam_server["endpoint"], iam_server["admin"]
    admin_s3, admin_iam = _client("s3", endpoint, akey, asecret), _client("iam", endpoint, akey, asecret)
    bucket, other = f"dedloc-{uuid.uuid4().hex[:10]}", f"other-{uuid.uuid4().hex[:10]}"
    admin_s3.create_bucket(Bucket=bucket)
    admin_s3.create_bucket(Bucket=other)
    admin_s3.put_object(Bucket=other, Key="x.json", Body=b"{}")
    admin_s3.put_object(Bucket=bucket, Key=f"{PREFIX}/{DataLayout('bn').card}", Body=b"{}")
    admin_s3.put_object(Bucket=bucket, Key="outside/secret.json", Body=b"{}")
    org = Bucket(f"s3://{bucket}/{PREFIX}", endpoint_url=endpoint,
                 storage_options={"key": akey, "secret": asecret, "client_kwargs": {"region_name": REGION}})
    init_run(org, small_config(RUN))
    doc = policy.policy_for(f"s3://{bucket}/{PREFIX}", RUN, ME, "aws")
    admin_iam.create_user(UserName=ME)
    admin_iam.put_user_policy(UserName=ME, PolicyName="dedloc-volunteer", PolicyDocument=json.dumps(doc))
    key = admin_iam.create_access_key(UserName=ME)["AccessKey"]
    me = (key["AccessKeyId"], key["SecretAccessKey"])
    return {"endpoint": endpoint, "bucket": bucket, "other": other, "admin": admin_s3,
            "me": _client("s3", endpoint, *me), "me_keys": me}


def _denied(call, *a, **kw) -> None:
    with pytest.raises(ClientError) as exc:
        call(*a, **kw)
    assert exc.value.response["Error"]["Code"] == "AccessDenied", exc.value.response["Error"]


KEYS = RunLayout(RUN)


def test_the_volunteer_writes_its_own_keys(collab):
    s3, b = collab["me"], collab["bucket"]
    shard = KEYS.shard(1, ME, PART)
    for key in (f"{shard}/values/zarr.json", f"{shard}/values/c/0", KEYS.manifest(shard), KEYS.progress(1, ME)):
        s3.put_object(Bucket=b, Key=f"{PREFIX}/{key}", Body=b"{}")
        assert s3.get_object(Bucket=b, Key=f"{PREFIX}/{key}")["Body"].read() == b"{}"
    claim = f"{PREFIX}/{KEYS.claim(3)}"
    s3.put_object(Bucket=b, Key=claim, Body=b'{"peer": "alice"}', IfNoneMatch="*")
    with pytest.raises(ClientError) as exc:  # create-once still holds for the claimant itself
        s3.put_object(Bucket=b, Key=claim, Body=b'{"peer": "alice"}', IfNoneMatch="*")
    assert exc.value.response["Error"]["Code"] == "PreconditionFailed"


@pytest.mark.parametrize("key", [
    KEYS.shard(1, OTHER, PART) + "/values/c/0",
    KEYS.manifest(KEYS.shard(1, OTHER, PART)),
    KEYS.progress(1, OTHER),
    KEYS.commit(1), KEYS.close(1), KEYS.config, KEYS.roster, KEYS.latest, KEYS.stop(),
    KEYS.params(1) + "/values/c/0", KEYS.delta(1) + "/codes/c/0", KEYS.applied(1, 0),
    KEYS.reduced(1) + "/values/c/0", KEYS.eval(1, "ner"),
    DataLayout("bn").card,
    f"{KEYS.manifests_dir(1)}/{OTHER}/manifests/{ME}/x.json",  # nested in another peer's folder
    f"{KEYS.shards_dir(1)}/{OTHER}/p/shards/{ME}/x",
    RunLayout("other").progress(1, ME),
], ids=lambda k: k.replace("/", "|"))
def test_everything_else_is_read_only(collab, key):
    _denied(collab["me"].put_object, Bucket=collab["bucket"], Key=f"{PREFIX}/{key}", Body=b"{}")


def test_nothing_can_be_deleted(collab):
    s3, admin, b = collab["me"], collab["admin"], collab["bucket"]
    own = f"{PREFIX}/{KEYS.progress(2, ME)}"
    s3.put_object(Bucket=b, Key=own, Body=b"{}")
    for key in (own, f"{PREFIX}/{KEYS.config}", f"{PREFIX}/{KEYS.commit(0)}"):
        _denied(s3.delete_object, Bucket=b, Key=key)
    out = s3.delete_objects(Bucket=b, Delete={"Objects": [{"Key": own}, {"Key": f"{PREFIX}/{KEYS.config}"}]})
    assert {e["Code"] for e in out.get("Errors", [])} == {"AccessDenied"} and not out.get("Deleted")
    for key in (own, f"{PREFIX}/{KEYS.config}", f"{PREFIX}/{KEYS.commit(0)}"):
        admin.head_object(Bucket=b, Key=key)  # all still there


def test_the_volunteer_reads_the_run_and_the_data_only(collab):
    s3, b = collab["me"], collab["bucket"]
    cfg = json.loads(s3.get_object(Bucket=b, Key=f"{PREFIX}/{KEYS.config}")["Body"].read())
    assert cfg["run"] == RUN
    s3.get_object(Bucket=b, Key=f"{PREFIX}/{DataLayout('bn').card}")
    listed = s3.list_objects_v2(Bucket=b, Prefix=f"{PREFIX}/{KEYS.states}/")
    assert any(o["Key"].endswith("COMMIT.json") for o in listed["Contents"])
    _denied(s3.get_object, Bucket=b, Key="outside/secret.json")
    _denied(s3.get_object, Bucket=collab["other"], Key="x.json")
    _denied(s3.list_objects_v2, Bucket=collab["other"])
    _denied(s3.put_object, Bucket=collab["other"], Key="x.json", Body=b"{}")
    _denied(s3.put_object, Bucket=b, Key="outside/x.json", Body=b"{}")


def test_a_real_worker_runs_on_these_rights(collab, monkeypatch):
    """The worker itself (s3fs, zarr) with the volunteer's keys: it syncs, computes, claims,
    reports and uploads a whole shard without one refused request; every listing prefix it
    sends satisfies the policy's s3:prefix condition (which moto does not evaluate)."""
    from s3fs import S3FileSystem

    prefixes: list[str] = []
    call = S3FileSystem._call_s3

    async def recording(self, method, *akwarglist, **kwargs):
        if method in ("list_objects_v2", "list_objects"):
            merged = {k: v for d in akwarglist for k, v in d.items()} | kwargs
            prefixes.append(merged.get("Prefix", ""))
        return await call(self, method, *akwarglist, **kwargs)

    monkeypatch.setattr(S3FileSystem, "_call_s3", recording)
    key, secret = collab["me_keys"]
    bucket = Bucket(f"s3://{collab['bucket']}/{PREFIX}", endpoint_url=collab["endpoint"],
                    storage_options={"key": key, "secret": secret, "client_kwargs": {"region_name": REGION}})
    assert bucket.create_json(KEYS.claim(9), {"peer": ME, "time": 1.0})
    assert not bucket.create_json(KEYS.claim(9), {"peer": ME, "time": 2.0})  # create-once holds
    w = Worker(Run(bucket, RUN), ME, micro_batch=4, threads=1, poll_s=0.2)
    w.sync()
    deadline = time.time() + 60
    while w.uploaded_samples == 0:
        assert time.time() < deadline, "the worker did not upload"
        w.step()
        w.flush()
    w.leave()
    manifests = bucket.find(f"{KEYS.manifests_dir(w.state)}/{ME}")
    assert manifests and collab["admin"].head_object(Bucket=collab["bucket"], Key=f"{PREFIX}/{manifests[0]}")
    assert prefixes, "the worker listed nothing: the prefix check below checked nothing"
    allowed = policy.volunteer_keys(PREFIX, RUN, ME).lists
    refused = [p for p in prefixes if not any(_iam_match(a, p) for a in allowed)]
    assert not refused, f"listings the s3:prefix condition would refuse: {sorted(set(refused))}"
