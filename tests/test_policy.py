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
- Cloudflare R2's temporary credentials (not emulated): the request body and what
  ``dedloc policy`` says of it are unit-tested.
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
from dedloc_pipeline.protocol.worker import Worker
from dedloc_pipeline.storage import vector
from dedloc_pipeline.storage.bucket import Bucket
from dedloc_pipeline.storage.layout import DataLayout, RunLayout
from dedloc_pipeline.trust import policy

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
    """An explicit Deny overrides any Allow; no Allow is the default deny."""
    return any(_iam_match(p, key) for p in k.writes) and not any(_iam_match(p, key) for p in k.deny_writes)


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
           "round_number", "generation_of", "holding"}


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
    objects, vector.write_vector, and its manifest)."""
    out = set()
    for r in ROUNDS:
        for part in parts:
            own = keys.shard(r, peer, part)
            out |= {f"{own}/{obj}" for obj in _shard_objects()} | {keys.manifest(own)}
        out.add(keys.progress(r, peer))
    return out


def test_the_grants_name_what_a_shard_of_any_codec_stores():
    assert {"*/" + obj.split("/", 1)[1] for obj in _shard_objects()} == set(policy.shard_objects())


@pytest.mark.parametrize("prefix", ["", PREFIX, "a/b.c"])
def test_only_the_volunteers_own_keys_are_writable(prefix):
    k = policy.volunteer_keys(prefix, RUN, ME)
    keys = RunLayout(RUN)
    mine = _volunteer_writes(keys)
    join = (lambda key: f"{prefix}/{key}") if prefix else (lambda key: key)
    checked = 0
    for what, key in _layout_keys(keys):
        assert _may_write(k, join(key)) == (key in mine), f"{what}: {key}"
        checked += 1
    assert checked > 40
    for key in _volunteer_writes(keys, OTHER):
        assert not _may_write(k, join(key)), key
    for key in (DataLayout("bn").card, DataLayout("bn").shard("train", 0), DataLayout("bn").unigram):
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


# Keys an attacker would write, each with the defences that refuse it. Removing those defences
# from the volunteer's patterns (_weaken) must let the key through: the control that each
# defence is what stops it. ME is the peer the credential is for.
KEYS = RunLayout(RUN)
NESTED_ME = f"{ME}.1"  # a volunteer's peer NAME.x, next to another volunteer's bob.1


def _in_folder(folder: str, key: str) -> str:
    """``key`` of round 5 moved to ``rounds/FOLDER/``."""
    return key.replace(KEYS.round(5), f"{KEYS.rounds_dir}/{folder}", 1)


def _weaken(k: policy.VolunteerKeys, defences: set[str], peer: str) -> policy.VolunteerKeys:
    writes, deny = list(k.writes), list(k.deny_writes)
    round_q = "/" + "?" * (len(KEYS.round(0)) - len(KEYS.rounds_dir) - 1) + "/"
    for d in defences:
        if d == "peer":  # another peer's keys: grant every peer's
            writes = [w.replace(f"/{peer}/", "/*/").replace(f"/{peer}.json", "/*.json") for w in writes]
        elif d == "separator":  # the peer's name as a prefix: alice*
            writes = [w.replace(f"/{peer}/", f"/{peer}*/").replace(f"/{peer}.json", f"/{peer}*.json") for w in writes]
        elif d == "round width":
            writes = [w.replace(round_q, "/*/") for w in writes]
        elif d == "part width":
            writes = [w.replace(policy.PART, "*") for w in writes]
        elif d == "round folders":  # what a grant on the whole run would allow
            writes = [w[:w.index("/rounds/")] + "/*" for w in writes]
        else:  # a Deny pattern, by how it ends
            assert sum(p.endswith(d) for p in deny) == 1, d
            deny = [p for p in deny if not p.endswith(d)]
    return replace(k, writes=tuple(writes), deny_writes=tuple(deny))


ATTACKS = [
    # another volunteer's shard, manifest, heartbeat
    (f"{KEYS.shard(5, OTHER, PART)}/values/c/0", {"peer"}),
    (KEYS.manifest(KEYS.shard(5, OTHER, PART)), {"peer"}),
    (KEYS.progress(5, OTHER), {"peer"}),
    # ME writing as alicebob
    (f"{KEYS.shard(5, ME + 'bob', PART)}/values/c/0", {"separator"}),
    (KEYS.manifest(KEYS.shard(5, ME + "bob", PART)), {"separator"}),
    (KEYS.progress(5, ME + "bob"), {"separator"}),
    # ME writing as alice.x/../bob: a wider grant for the name would still meet the depth checks
    (f"{KEYS.shards_dir(5)}/{ME}.x/../{OTHER}/{PART}/values/c/0", {"separator", "/shards/*/*/*/*/*/*"}),
    (f"{KEYS.manifests_dir(5)}/{ME}.x/../{OTHER}/{PART}.json", {"separator", "/manifests/*/*/*"}),
    # nested in the own folder: keys that normalize into another peer's, or parse as another's
    (f"{KEYS.shard(5, NESTED_ME, PART)}/../../{OTHER}.1/{PART}/values/c/0", {"/shards/*/*/*/*/*/*"}),
    (f"{KEYS.manifests_dir(5)}/{ME}/1/../../{OTHER}/a-abcdef.json", {"/manifests/*/*/*"}),
    # extra path segments: in an array's name, in a part
    (f"{KEYS.shard(5, ME, PART)}/values/x/c/0", {"/shards/*/*/*/*/*/*"}),
    (f"{KEYS.shards_dir(5)}/{ME}/00017000/0000-abcdef/values/c/0", {"/shards/*/*/*/*/*/*"}),
    # parts off the part pattern
    (KEYS.manifest(KEYS.shard(5, ME, "x")), {"part width"}),
    (f"{KEYS.shard(5, ME, 'x')}/values/c/0", {"part width"}),
    # unrelated round-like folders: another width, or an 8-character one with a folder inside
    (_in_folder("0000005", KEYS.progress(5, ME)), {"round width"}),
    (_in_folder("000000005", KEYS.manifest(KEYS.shard(5, ME, PART))), {"round width"}),
    (_in_folder("latest", KEYS.progress(5, ME)), {"round width"}),
    (_in_folder("0000/000", KEYS.progress(5, ME)), {"/*/*/progress/*"}),
    (_in_folder("0000/000", KEYS.manifest(KEYS.shard(5, ME, PART))), {"/*/*/manifests/*"}),
    (_in_folder("0000/000", KEYS.shard(5, ME, PART) + "/values/c/0"), {"/*/*/shards/*"}),
    # the run's records and the organizer's objects
    *((key, {"round folders"}) for key in (
        KEYS.config, KEYS.roster, KEYS.view, KEYS.latest, KEYS.stop(), KEYS.commit(5), KEYS.close(5), KEYS.streams(5),
        f"{KEYS.params(5)}/values/c/0", f"{KEYS.delta(5)}/codes/c/0", KEYS.optim(5, "exp_avg") + "/values/c/0",
        KEYS.applied(5, 0), f"{KEYS.reduced(5)}/values/c/0", KEYS.eval(5, "ner"), KEYS.report(),
        f"{KEYS.frozen(KEYS.shard(5, ME, PART))}/shard/c/0")),  # its own shard's frozen copy too
]


@pytest.mark.parametrize("key, defences", ATTACKS, ids=[k.replace("/", "|") for k, _ in ATTACKS])
def test_an_attack_key_is_refused_and_only_its_defences_refuse_it(key, defences):
    peer = NESTED_ME if f"/{NESTED_ME}/" in key else ME
    k = policy.volunteer_keys(PREFIX, RUN, peer)
    doc = policy.policy_for(f"s3://collab-bucket/{PREFIX}", RUN, peer, "aws")
    assert not _may_write(k, f"{PREFIX}/{key}") and not _allowed(doc, "s3:PutObject", f"{PREFIX}/{key}")
    assert _may_write(_weaken(k, defences, peer), f"{PREFIX}/{key}"), f"the control: without {defences}"


def test_no_wildcard_of_a_grant_can_stand_for_a_separator():
    """Each grant with each of its wildcards made a '/' (and every other one honest): refused.
    And every Deny pattern is needed: without it, one of these keys gets through."""
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    honest = {"?": "0", "*": "values"}
    attacks = set()
    for w in k.writes:
        for i, c in enumerate(w):
            if c in honest:
                key = "".join(("/" if c == "?" else "x/y") if j == i else honest.get(x, x) for j, x in enumerate(w))
                assert not _may_write(k, key), key
                attacks.add(key)
        assert _may_write(k, "".join(honest.get(x, x) for x in w)), w
    assert attacks
    for d in k.deny_writes:
        without = replace(k, deny_writes=tuple(p for p in k.deny_writes if p != d))
        assert any(_may_write(without, key) for key in attacks), f"{d} refuses none of them"


def test_another_run_or_prefix_is_refused():
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    assert not _may_write(k, f"{PREFIX}/{RunLayout('other').progress(5, ME)}")
    assert not _may_write(k, f"elsewhere/{KEYS.progress(5, ME)}")
    assert not _may_write(k, KEYS.progress(5, ME))


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
    k = policy.volunteer_keys(PREFIX, RUN, ME)
    assert by_sid["WriteOwnKeys"]["Resource"] == [f"arn:aws:s3:::collab-bucket/{p}" for p in k.writes]
    assert by_sid["NoFoldersTheLayoutLacks"] == {
        "Sid": "NoFoldersTheLayoutLacks", "Effect": "Deny", "Action": "s3:PutObject",
        "Resource": [f"arn:aws:s3:::collab-bucket/{p}" for p in k.deny_writes]}
    assert json.loads(json.dumps(doc)) == doc
    # IAM's limit for session policies and a user's inline policies is 2,048 characters
    assert len(json.dumps(doc, separators=(",", ":"))) < 1450
    ordinary = policy.policy_for("s3://collab-bucket/sahajbert", "sahajbert", "alice.laptop", "aws")
    assert len(json.dumps(ordinary, separators=(",", ":"))) < 1600
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


def test_dedloc_policy_r2_says_what_the_credential_still_allows():
    """The request body on stdout (for ``curl --data @file``), on stderr what R2's single
    permission leaves the volunteer able to do and what the protocol catches of it."""
    from typer.testing import CliRunner

    from dedloc_pipeline.cli import app
    res = CliRunner().invoke(app, ["policy", "--bucket", "s3://collab-bucket/collab", "--run", RUN, "--peer", ME,
                                   "--format", "r2", "--ttl", "3600", "--data", "bn"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["prefixes"] == [f"collab/runs/{RUN}/", "collab/data/bn/"] and body["ttlSeconds"] == 3600
    text = res.stderr
    assert text == policy.r2_notice("s3://collab-bucket/collab", RUN, ME, "bn", 3600)
    can, catches = text.split("The protocol's checks still catch:")
    catches, uncaught = catches.split("Nothing catches:")
    for p in body["prefixes"]:
        assert f"  collab-bucket/{p}\n" in can
    assert "expires after 3600 s" in can
    for what in ("read and list every object", "write any key, not only its own", "overwrite or delete any object"):
        assert what in can
    # the organizer's records it names are the layout's, and each is either checked or said not to be
    records = {KEYS.config, KEYS.roster, KEYS.view, KEYS.stop(), KEYS.streams(1), KEYS.commit(1), KEYS.latest,
               KEYS.close(1), DataLayout("bn").card}
    for name in {key.rsplit("/", 1)[-1] for key in records}:
        assert name in can and (name in catches or name in uncaught), name
    for what in ("checksum", "signed by the enrolled, unrevoked key", "another peer's name", "ROSTER.json",
                 "heartbeat keys"):
        assert what in catches
    for what in ("none of it is signed", "without checksums", "deletes", "without an organizer key"):
        assert what in uncaught
    assert "pins the organizer's key" in catches and "VIEW.json or STOP.json" in catches
    assert "trust" in uncaught and "docs/security.md" in uncaught
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
            "me": _client("s3", endpoint, *me), "me_keys": me}


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


@pytest.mark.parametrize("key", [key for key, _ in ATTACKS if f"/{NESTED_ME}/" not in key]
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


def test_a_real_worker_runs_on_these_rights(collab, monkeypatch):
    """The worker itself (s3fs, zarr) with the volunteer's keys: it syncs, computes, reports and
    uploads a whole shard without one refused request, its part named as ``policy.PART`` says;
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
    w.sync()
    deadline = time.time() + 60
    while w.uploaded_samples == 0:
        assert time.time() < deadline, "the worker did not upload"
        w.step()
        w.flush()
    w.leave()
    manifests = bucket.find(f"{KEYS.manifests_dir(w.state)}/{ME}")
    assert manifests and collab["admin"].head_object(Bucket=collab["bucket"], Key=f"{PREFIX}/{manifests[0]}")
    for m in manifests:
        _, _, part = KEYS.shard_parts(KEYS.shard_of(m))
        assert _iam_match(policy.PART, part) and len(part) == len(policy.PART), part
    assert prefixes, "the worker listed nothing: the prefix check below checked nothing"
    allowed = policy.volunteer_keys(PREFIX, RUN, ME).lists
    refused = [p for p in prefixes if not any(_iam_match(a, p) for a in allowed)]
    assert not refused, f"listings the s3:prefix condition would refuse: {sorted(set(refused))}"
