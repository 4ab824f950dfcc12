"""Least-privilege volunteer credentials (dedloc_pipeline/trust/policy.py): the patterns under
IAM's wildcard semantics, and a bucket that enforces them.

A separate moto server is started here with IAM enforcement on (``INITIAL_NO_AUTH_ACTION_COUNT``:
moto serves that many requests unauthenticated, then checks every request's signature and
the caller's IAM policies). The first requests create an admin user; the admin creates the
bucket, the run, and a volunteer user with the generated policy as its inline policy
(``put_user_policy``); the volunteer's requests are then signed with its own keys.

What moto (5.2) enforces, and so what these tests prove: the request's signature and access
key; the policy's grammar (``put_user_policy`` rejects malformed documents); ``Action`` and
``Resource`` matching; explicit ``Deny`` over ``Allow``; the default deny (so deletes, other
peers' keys, the organizer's markers and other buckets are refused).

Moto matches a pattern as a regular expression with each ``*`` made ``.*``: it has no ``?``
(a regex quantifier there, so ``??`` fails to compile) and takes ``.`` for any character. The
server is started with its matcher replaced by IAM's (``_iam_regex``, the one the unit tests
use), so the patterns' semantics are the unit tests' and the rest is moto's.

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
- Cloudflare R2's temporary credentials (not emulated): each of the two is stood for by an IAM
  user with R2's permission on its plain prefixes (``test_a_real_worker_runs_on_r2s_two_credentials``),
  and the request bodies and what ``dedloc policy`` says of them are unit-tested.
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
import typing
import uuid
from dataclasses import replace

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from dedloc_pipeline.protocol.config import Codec
from dedloc_pipeline.protocol.run import Run, init_run
from dedloc_pipeline.storage import vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import DataLayout, RunLayout
from dedloc_pipeline.trust import policy
from dedloc_pipeline.volunteer.worker import Worker

from .conftest import _free_port, small_config

PREFIX = "collab"
RUN = "least"
ME, OTHER = "alice", "bob"
REGION = "us-east-1"
ROUNDS = [0, 5, 12345678]
PART = "0001700000000-abcdef"  # as storage.part.name names one
BOOTSTRAP = 3  # unauthenticated requests: create the admin user, its policy, its access key


def _iam_regex(pattern: str) -> str:
    """IAM's wildcards as a regular expression: '*' any run of characters and '?' any one, '/'
    included in both; everything else literal."""
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)


def _iam_match(pattern: str, key: str) -> bool:
    return re.fullmatch(_iam_regex(pattern), key, re.DOTALL) is not None


def _may_write(k: policy.VolunteerKeys, key: str) -> bool:
    return _iam_match(k.writes, key)


def _allowed(doc: dict, action: str, key: str, bucket: str = "collab-bucket") -> bool:
    """IAM's evaluation of one request against every statement of a policy document (none of
    the PutObject/GetObject statements has a Condition)."""
    def hit(values, value):
        return any(_iam_match(v, value) for v in ([values] if isinstance(values, str) else values))

    effects = {s["Effect"] for s in doc["Statement"] if "Condition" not in s
               and hit(s["Action"], action) and hit(s["Resource"], f"arn:aws:s3:::{bucket}/{key}")}
    return "Allow" in effects and "Deny" not in effects


def test_the_matcher_has_iams_semantics():
    assert _iam_match("a/*/c", "a/b/x/c") and _iam_match("a/*", "a/") and _iam_match("a?c", "a/c")
    assert not _iam_match("a?c", "ac") and not _iam_match("a?c", "abbc") and not _iam_match("a.c", "abc")
    assert not _iam_match("a*", "b/a") and _iam_match("a*", "a\nb")
    doc = {"Statement": [{"Effect": "Allow", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::collab-bucket/a/*"},
                         {"Effect": "Deny", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::collab-bucket/a/x*"}]}
    assert _allowed(doc, "s3:PutObject", "a/b") and not _allowed(doc, "s3:PutObject", "a/xb")
    assert not _allowed(doc, "s3:GetObject", "a/b") and not _allowed(doc, "s3:PutObject", "b/a")


# ---------------------------------------------------------------------------------------------
# the layout: every key RunLayout can produce is writable by the volunteer only where it should be


# RunLayout's methods that take a key apart rather than make one
PARSERS = {"round_of", "shard_parts", "shard_holding", "peer_of_progress", "state_number", "number_of",
           "round_number", "generation_of", "holding", "written", "of_round", "writer", "shard_of", "part_number",
           "state_path", "applied_part"}


def _layout_keys(keys: RunLayout) -> list[tuple[str, str]]:
    """(description, key) for every method and property of RunLayout, called with a few rounds,
    both peers, and parts; a method with a parameter this test does not know fails the test,
    so a new kind of key cannot slip past it."""
    shard = {p: keys.shard(5, p, PART) for p in (ME, OTHER)}
    values = {
        "r": ROUNDS, "s": ROUNDS, "peer": [ME, OTHER], "name": ["m", "v"], "task": ["ner"],
        "version": [1, 42], "volunteer": [ME, OTHER],  # roster versions, the validator's flags: the organizer's
        "generation": [1, 42],  # the scheduler's lease
        "stamp": ["20270115T080000Z"], "key": [keys.commit(5), keys.progress(5, ME)],  # a repair's quarantine
        "shard": list(shard.values()), "manifest": [keys.manifest(s) for s in shard.values()],
        "path": ["params/values/c/0", "optim/exp_avg/values/c/1"],  # below a state, or an aggregator's answer
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


def _shard_objects() -> set[str]:
    """What a shard of every codec stores below its key: the chunk object of each array (a
    peer's shard is written whole, its metadata the run's: Run.grad_format)."""
    out = set()
    for name in typing.get_args(Codec):
        fmt = vector.VectorFormat(name, n=5000, chunk_size=1024, block=64, whole=True)
        out |= vector.chunk_objects(fmt)
    return out


def _volunteer_writes(keys: RunLayout, peer: str = ME, parts: tuple[str, ...] = (PART,)) -> set[str]:
    """The keys the code has a volunteer write (worker.py: heartbeats; shard.py: a shard's
    objects, vector.write_vector, and its manifest; volunteer/aggregator.py: an aggregator's offer, and a
    part's claim, answer objects and result, with LAMB its sums' claim and sums)."""
    out = set()
    for r in ROUNDS:
        for part in parts:
            own = keys.shard(r, peer, part)
            out |= {f"{own}/{obj}" for obj in _shard_objects()} | {keys.manifest(own)}
        out.add(keys.progress(r, peer))
        out |= {keys.offer(r, peer), keys.claim(r, peer, 3), keys.result(r, peer, 3), keys.sum_claim(r, peer, 3),
                keys.sums(r, peer, 3),
                *(keys.answer_object(r, peer, 3, path) for path in ("params/values/c/7", "optim/exp_avg/values/c/7"))}
    return out


@pytest.mark.parametrize("prefix", ["", PREFIX, "a/b.c"])
def test_only_the_volunteers_own_keys_are_writable(prefix):
    """Every key the layout makes is writable exactly when it lies below the volunteer's own
    prefix, and every key the code has it write does."""
    k = policy.volunteer_keys(prefix, RUN, ME)
    keys = RunLayout(RUN)
    join = (lambda key: f"{prefix}/{key}") if prefix else (lambda key: key)
    own = keys.volunteer_dir(ME) + "/"
    assert k.own == join(own) and k.writes == join(own) + "*"
    checked = 0
    for what, key in _layout_keys(keys):
        assert _may_write(k, join(key)) == key.startswith(own), f"{what}: {key}"
        checked += 1
    assert checked > 40
    for key in _volunteer_writes(keys):
        assert _may_write(k, join(key)), key
    for key in _volunteer_writes(keys, OTHER):
        assert not _may_write(k, join(key)), key
    data = DataLayout("bn")
    for key in (data.card, data.shard("0123456789abcdef", "train", 0), data.unigram):
        assert not _may_write(k, join(key))


def test_every_statement_of_the_document_lets_the_honest_keys_through():
    doc = policy.policy_for(f"s3://collab-bucket/{PREFIX}", RUN, ME, "aws")
    keys = RunLayout(RUN)
    for key in _volunteer_writes(keys):
        assert _allowed(doc, "s3:PutObject", f"{PREFIX}/{key}"), key
        assert _allowed(doc, "s3:GetObject", f"{PREFIX}/{key}"), key
        assert not _allowed(doc, "s3:DeleteObject", f"{PREFIX}/{key}"), key
    for key in (keys.config, keys.roster, keys.view, keys.commit(3), keys.stop()):
        assert _allowed(doc, "s3:GetObject", f"{PREFIX}/{key}") and not _allowed(doc, "s3:PutObject", f"{PREFIX}/{key}")


# Keys an attacker would write, each with the defence that refuses it. Removing the defence from
# the volunteer's grant (_weaken) must let the key through: the control that it is what stops
# it. ME is the peer the credential is for.
KEYS = RunLayout(RUN)


def _weaken(k: policy.VolunteerKeys, defence: str) -> policy.VolunteerKeys:
    if defence == "peer":  # every peer's prefix
        return replace(k, writes=k.writes.replace(f"/{ME}/", "/*/"))
    if defence == "separator":  # the peer's name as a prefix: alice*
        return replace(k, writes=k.writes.replace(f"/{ME}/", f"/{ME}*/"))
    assert defence == "run", defence  # a grant on the whole run (what one R2 credential had)
    return replace(k, writes=k.writes.replace(f"volunteers/{ME}/", ""))


ATTACKS = [
    # another volunteer's shard, manifest, heartbeat
    (f"{KEYS.shard(5, OTHER, PART)}/shard/c/0", "peer"),
    (KEYS.manifest(KEYS.shard(5, OTHER, PART)), "peer"),
    (KEYS.progress(5, OTHER), "peer"),
    (f"{KEYS.volunteer_dir(OTHER)}/anything", "peer"),
    # ME writing as alicebob, or as alice.x (a peer id of the same volunteer: a credential of its own)
    (f"{KEYS.shard(5, ME + 'bob', PART)}/shard/c/0", "separator"),
    (KEYS.progress(5, ME + "bob"), "separator"),
    (KEYS.manifest(KEYS.shard(5, ME + ".x", PART)), "separator"),
    # the run's records and the organizer's objects
    *((key, "run") for key in (
        KEYS.config, KEYS.roster, KEYS.view, KEYS.latest, KEYS.stop(), KEYS.commit(5), KEYS.close(5), KEYS.streams(5),
        f"{KEYS.params(5)}/values/c/0", f"{KEYS.delta(5)}/codes/c/0", KEYS.optim(5, "exp_avg") + "/values/c/0",
        KEYS.applied(5, 0), f"{KEYS.reduced(5)}/values/c/0", KEYS.eval(5, "ner"), KEYS.report(), KEYS.lease(3),
        KEYS.flag(ME), KEYS.verdicts(5), KEYS.roster_version(2),
        f"{KEYS.frozen(KEYS.shard(5, ME, PART))}/shard/c/0")),  # its own shard's frozen copy too
]


@pytest.mark.parametrize("key, defence", ATTACKS, ids=[k.replace("/", "|") for k, _ in ATTACKS])
def test_an_attack_key_is_refused_and_only_its_defence_refuses_it(key, defence):
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    doc = policy.policy_for(f"s3://collab-bucket/{PREFIX}", RUN, ME, "aws")
    assert not _may_write(k, f"{PREFIX}/{key}") and not _allowed(doc, "s3:PutObject", f"{PREFIX}/{key}")
    assert not f"{PREFIX}/{key}".startswith(k.own)  # R2's plain prefix refuses it too
    assert _may_write(_weaken(k, defence), f"{PREFIX}/{key}"), f"the control: without {defence}"


OFF_LAYOUT = [  # what a volunteer can write in its own prefix, and no reader takes
    f"{KEYS.volunteer_dir(ME)}/00000005/shards/../../../{OTHER}/00000005/progress.json",
    f"{KEYS.volunteer_dir(ME)}/../{OTHER}/00000005/progress.json",
    f"{KEYS.volunteer_dir(ME)}/0000005/progress.json", f"{KEYS.volunteer_dir(ME)}/latest/progress.json",
    f"{KEYS.manifests_dir(5, ME)}/x/{PART}.json", f"{KEYS.manifests_dir(5, ME)}/{PART}",
    f"{KEYS.manifests_dir(5, ME)}/..json", f"{KEYS.volunteer_dir(ME)}/00000005/progress.json/x",
    f"{KEYS.volunteer_dir(ME)}/00000005/CLOSE.json", f"{KEYS.volunteer_dir(ME)}/run.json",
]


@pytest.mark.parametrize("key", OFF_LAYOUT, ids=lambda k: k.replace("/", "|"))
def test_what_a_volunteer_writes_off_the_layout_is_nobodys_key(key):
    """Inside its own prefix a volunteer writes anything (R2 cannot narrow it): a key the layout
    does not make parses as nothing, and a key it does is counted for the prefix's peer only."""
    assert _may_write(policy.volunteer_keys("", RUN, ME), key)
    assert KEYS.written(key) is None and KEYS.of_round([key], 5, "progress") == []
    assert all(KEYS.written(k).peer == ME for k in _volunteer_writes(KEYS))


def test_another_run_or_prefix_is_refused():
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    assert not _may_write(k, f"{PREFIX}/{RunLayout('other').progress(5, ME)}")
    assert not _may_write(k, f"elsewhere/{KEYS.progress(5, ME)}")
    assert not _may_write(k, KEYS.progress(5, ME))


def test_reads_cover_the_run_and_the_data_only():
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    keys = RunLayout(RUN)
    for key in (keys.config, keys.commit(3), keys.params(3) + "/values/c/0", keys.close(3), keys.stop(),
                DataLayout("bn").card, DataLayout("bn").shard("0123456789abcdef", "train", 2)):
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
    assert {s["Effect"] for s in doc["Statement"]} == {"Allow"}  # no Deny needed: one prefix
    assert by_sid["WriteOwnPrefix"]["Resource"] == f"arn:aws:s3:::collab-bucket/{PREFIX}/runs/{RUN}/volunteers/{ME}/*"
    assert json.loads(json.dumps(doc)) == doc
    # IAM's limit for session policies and a user's inline policies is 2,048 characters
    assert len(json.dumps(doc, separators=(",", ":"))) < 700
    gov = policy.aws_policy("collab-bucket", "", RUN, ME, partition="aws-us-gov")
    assert all(r.startswith("arn:aws-us-gov:s3:::collab-bucket") for s in gov["Statement"]
               for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]))


def test_the_r2_request_bodies():
    """Two credentials: read-only on the run and the data sets, read-write on the own prefix."""
    bodies = policy.policy_for("s3://collab-bucket/collab", RUN, ME, "r2", parent_access_key_id="abc123",
                               ttl_seconds=3600)
    common = {"bucket": "collab-bucket", "parentAccessKeyId": "abc123", "ttlSeconds": 3600}
    assert bodies == {
        "read": {**common, "permission": "object-read-only", "prefixes": [f"collab/runs/{RUN}/", "collab/data/"]},
        "write": {**common, "permission": "object-read-write", "prefixes": [f"collab/runs/{RUN}/volunteers/{ME}/"]}}
    keys = RunLayout(RUN)
    for key in _volunteer_writes(keys):  # everything the worker writes
        assert f"collab/{key}".startswith(bodies["write"]["prefixes"][0]), key
    for key in (*_volunteer_writes(keys, OTHER), *_volunteer_writes(keys, ME + "bob"), keys.config, keys.stop()):
        assert not f"collab/{key}".startswith(bodies["write"]["prefixes"][0]), key
    for key in _volunteer_writes(keys) | {keys.config, keys.stop(), keys.view}:  # everything the worker reads
        assert any(f"collab/{key}".startswith(p) for p in bodies["read"]["prefixes"]), key
    assert not any(f"collab/{RunLayout(RUN + 'x').config}".startswith(p) for p in bodies["read"]["prefixes"])
    default = policy.policy_for("s3://collab-bucket", RUN, ME, "r2", data="bn")
    assert default["read"]["prefixes"] == [f"runs/{RUN}/", "data/bn/"]
    assert default["write"]["ttlSeconds"] == 86400
    assert default["write"]["parentAccessKeyId"] == policy.PARENT_KEY_PLACEHOLDER


def test_dedloc_policy_r2_says_what_each_credential_is_for():
    """The request bodies on stdout (for ``curl --data``), on stderr which is which and what the
    write credential leaves its holder able to do in its own prefix."""
    from typer.testing import CliRunner

    from dedloc_pipeline.cli import app
    res = CliRunner().invoke(app, ["policy", "--bucket", "s3://collab-bucket/collab", "--run", RUN, "--peer", ME,
                                   "--format", "r2", "--ttl", "3600", "--data", "bn"])
    assert res.exit_code == 0, res.output
    bodies = json.loads(res.stdout)
    assert bodies["read"]["prefixes"] == [f"collab/runs/{RUN}/", "collab/data/bn/"]
    text = res.stderr
    assert text == policy.r2_notice("s3://collab-bucket/collab", RUN, ME, "bn", 3600)
    for p in bodies["read"]["prefixes"] + bodies["write"]["prefixes"]:
        assert f"  collab-bucket/{p}\n" in text
    assert "expiring after 3600 s" in text and "--write-profile" in text
    for what in ("overwrite and delete", "frozen/", "never read", "read-only to this volunteer"):
        assert what in text
    assert "trust" not in text  # no "only with volunteers you trust" any more
    aws = CliRunner().invoke(app, ["policy", "--bucket", "s3://collab-bucket/collab", "--run", RUN, "--peer", ME])
    assert aws.exit_code == 0 and aws.stderr == "" and json.loads(aws.stdout)["Version"] == "2012-10-17"


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


MOTO_WITH_IAM_WILDCARDS = f"""
import re, sys
from moto.iam.access_control import IAMPolicyStatement
from moto.server import main
{inspect.getsource(_iam_regex)}
IAMPolicyStatement._match = staticmethod(lambda pattern, s: re.fullmatch(_iam_regex(pattern), s, re.DOTALL))
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def iam_server(tmp_path_factory):
    """A moto server of its own that authenticates and authorizes every request after BOOTSTRAP."""
    port = _free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(BOOTSTRAP), AWS_DEFAULT_REGION=REGION)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        env.pop(k, None)
    log = tmp_path_factory.mktemp("moto-iam") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", MOTO_WITH_IAM_WILDCARDS, "-H", "127.0.0.1", "-p", str(port)],
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
            "admin_keys": (akey, asecret), "me": _client("s3", endpoint, *me), "me_keys": me}


def _denied(call, *a, **kw) -> None:
    with pytest.raises(ClientError) as exc:
        call(*a, **kw)
    assert exc.value.response["Error"]["Code"] == "AccessDenied", exc.value.response["Error"]



def test_the_volunteer_writes_its_own_keys(collab):
    s3, b = collab["me"], collab["bucket"]
    shard = KEYS.shard(1, ME, PART)
    for key in sorted({f"{shard}/{obj}" for obj in _shard_objects()} | {KEYS.manifest(shard), KEYS.progress(1, ME)}):
        s3.put_object(Bucket=b, Key=f"{PREFIX}/{key}", Body=b"{}")
        assert s3.get_object(Bucket=b, Key=f"{PREFIX}/{key}")["Body"].read() == b"{}"


@pytest.mark.parametrize("key", [key for key, _ in ATTACKS]
                         + [DataLayout("bn").card, RunLayout("other").progress(1, ME)],
                         ids=lambda k: k.replace("/", "|"))
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


def _until_it_uploads(w) -> None:
    """Sync, then step until a shard is uploaded (a minute at most), and leave."""
    w.sync()
    deadline = time.time() + 60
    while w.uploaded_samples == 0:
        assert time.time() < deadline, "the worker did not upload"
        w.step()
        w.flush()
    w.leave()


def test_a_real_worker_runs_on_these_rights(collab, monkeypatch):
    """The worker itself (s3fs, zarr) with the volunteer's keys: it syncs, computes, reports and
    uploads a whole shard without one refused request, all of it below its own prefix;
    every listing prefix it sends satisfies the policy's s3:prefix condition (which moto does
    not evaluate)."""
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
    w = Worker(Run(bucket, RUN), ME, micro_batch=4, threads=1, poll_s=0.2)
    _until_it_uploads(w)
    manifests = bucket.find(KEYS.manifests_dir(w.state, ME))
    assert manifests and collab["admin"].head_object(Bucket=collab["bucket"], Key=f"{PREFIX}/{manifests[0]}")
    assert all(KEYS.written(m).peer == ME for m in manifests)
    assert prefixes, "the worker listed nothing: the prefix check below checked nothing"
    allowed = policy.volunteer_keys(PREFIX, RUN, ME).lists
    refused = [p for p in prefixes if not any(_iam_match(a, p) for a in allowed)]
    assert not refused, f"listings the s3:prefix condition would refuse: {sorted(set(refused))}"


R2_READ_ONLY = ("s3:GetObject", "s3:ListBucket")  # R2's object-read-only, as IAM actions
R2_READ_WRITE = ("s3:GetObject", "s3:ListBucket", "s3:PutObject", "s3:DeleteObject")  # object-read-write


def _r2_like_user(iam, name: str, bucket: str, actions: tuple[str, ...], prefixes: list[str]) -> tuple[str, str]:
    """An IAM user standing for one R2 temporary credential: ``actions`` on every key below the
    plain ``prefixes``, as R2 grants them (moto does not emulate R2's credentials)."""
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="r2", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": [a for a in actions if a != "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{bucket}/{p}*" for p in prefixes]},
            {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"}]}))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def test_a_real_worker_runs_on_r2s_two_credentials(collab, tmp_path, monkeypatch):
    """What `dedloc policy --format r2` asks R2 for, held as R2 would grant it: the read-only
    credential cannot write the volunteer's own prefix and the read-write one cannot write
    anything else (the controls), and a real worker given both (`--write-profile`) syncs,
    computes and uploads a whole shard without one refused request."""
    from dedloc_pipeline.monitoring.volunteer import make_worker

    endpoint, b = collab["endpoint"], collab["bucket"]
    peer = "carol"
    admin_iam = _client("iam", endpoint, *collab["admin_keys"])
    bodies = policy.policy_for(f"s3://{b}/{PREFIX}", RUN, peer, "r2")
    read = _r2_like_user(admin_iam, "carol-read", b, R2_READ_ONLY, bodies["read"]["prefixes"])
    write = _r2_like_user(admin_iam, "carol-write", b, R2_READ_WRITE, bodies["write"]["prefixes"])
    own = f"{PREFIX}/{KEYS.progress(0, peer)}"
    _denied(_client("s3", endpoint, *read).put_object, Bucket=b, Key=own, Body=b"{}")
    for key in (KEYS.stop(), KEYS.view, KEYS.config, KEYS.progress(0, ME)):
        _denied(_client("s3", endpoint, *write).put_object, Bucket=b, Key=f"{PREFIX}/{key}", Body=b"{}")
    creds = tmp_path / "credentials"
    creds.write_text(f"[carol-write]\naws_access_key_id = {write[0]}\naws_secret_access_key = {write[1]}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", read[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", read[1])
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    w = make_worker(f"s3://{b}/{PREFIX}", RUN, peer, micro_batch=4, threads=1, poll=0.2, endpoint_url=endpoint,
                    device="cpu", write_profile="carol-write")
    _until_it_uploads(w)
    manifests = collab["admin"].list_objects_v2(Bucket=b, Prefix=f"{PREFIX}/{KEYS.manifests_dir(w.state, peer)}/")
    assert manifests.get("Contents")
