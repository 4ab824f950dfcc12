"""Least-privilege bucket credentials for one volunteer (``dedloc policy``).

A volunteer writes only under its own peer id: its shard chunks, its manifests, its heartbeats,
and the create-once claims of the data blocks it streams. It reads the run and the data sets and
lists below them. Everything else in the run (run.json, COMMIT, CLOSE, LATEST, STOP, the
parameters, the aggregators' scratch) is written by the organizer alone, whose own credentials
never leave the organizer's machines.

Every key pattern is derived from ``RunLayout`` and ``DataLayout``, so the policy follows the
layout instead of spelling keys a second time; ``tests/test_policy.py`` checks every key the
layout can produce against these patterns.

Formats: ``aws`` (an IAM policy document: an STS session policy, or an IAM user's inline or
managed policy), ``minio`` (the same document: MinIO reads the AWS policy grammar, the
``s3:prefix`` condition and ``Deny`` included) and ``r2`` (the body of Cloudflare R2's
temporary-credentials request, which can scope a credential to prefixes but gives it a single
permission: see ``r2_temp_credentials_request``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..storage.layout import PEER_ID, ROUND_FOLDERS, DataLayout, RunLayout, is_name

FORMATS = ("aws", "minio", "r2")

# A run name follows the same pattern as a peer id (config.RunConfig.run); a data set name is
# used in keys the same way, so it gets the same check.
NAME = PEER_ID
# S3 general-purpose bucket names; R2 allows no dots.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_R2_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
# One segment of the bucket prefix. No '*' or '?' (they would widen a Resource or an s3:prefix
# pattern), no '$' (IAM policy variables), no empty, '.' or '..' segments.
_SEGMENT = re.compile(r"^[A-Za-z0-9_=+-][A-Za-z0-9._=+-]*$")

R2_MAX_TTL_S = 604800  # R2's limit: 7 days
PARENT_KEY_PLACEHOLDER = "<PARENT_ACCESS_KEY_ID>"


def parse_bucket_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (prefix may be empty)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"bucket URL {url!r}: expected s3://BUCKET[/PREFIX] (policies exist only for S3 buckets)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def _check_bucket(bucket: str, r2: bool = False) -> None:
    ok = _R2_BUCKET if r2 else _BUCKET
    if not isinstance(bucket, str) or not ok.fullmatch(bucket) or ".." in bucket:
        kind = "an R2 bucket name: 3-63 of a-z, 0-9, '-'" if r2 else \
            "an S3 bucket name: 3-63 of a-z, 0-9, '.', '-', starting and ending with a letter or digit"
        raise ValueError(f"bucket {bucket!r} is not {kind}")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str):
        raise ValueError(f"prefix {prefix!r} must be a string")
    if prefix == "":
        return
    for seg in prefix.split("/"):
        if not _SEGMENT.fullmatch(seg):
            raise ValueError(f"bucket prefix {prefix!r}: segment {seg!r} must be non-empty and use only "
                             "A-Z a-z 0-9 . _ = + - (no wildcards, no '$', no '.' or '..' segments)")


def _check_name(what: str, value: str) -> None:
    if not is_name(value):
        raise ValueError(f"{what} {value!r} must match {NAME}")


@dataclass(frozen=True)
class VolunteerKeys:
    """Key patterns (IAM wildcards: ``*`` any run of characters, '/' included), bucket-relative."""

    reads: tuple[str, ...]        # GetObject
    lists: tuple[str, ...]        # s3:prefix values ListBucket accepts
    writes: tuple[str, ...]       # PutObject
    deny_writes: tuple[str, ...]  # PutObject refused even where `writes` matches
    prefixes: tuple[str, ...]     # plain prefixes (R2): the run and the data sets, '/'-terminated


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def volunteer_keys(prefix: str, run: str, peer: str, data: str | None = None) -> VolunteerKeys:
    """What peer ``peer`` of run ``run`` under bucket prefix ``prefix`` reads, lists and writes.

    Rounds are the only variable part of a volunteer's keys, so the round segment becomes ``*``.
    IAM's ``*`` also matches '/', so ``rounds/*/shards/PEER/*`` alone would let the peer write
    ``rounds/R/manifests/OTHER/shards/PEER/x``: inside another peer's manifest folder, which that
    peer lists when it resumes. ``deny_writes`` closes this: a legitimate key has a single
    8-digit segment between ``rounds/`` and ``shards|manifests|progress``, so ``rounds/*/*/shards/*``
    (two segments or more) never matches one.
    """
    _check_prefix(prefix)
    _check_name("run", run)
    _check_name("peer id", peer)
    if data is not None:
        _check_name("data set", data)
    keys = RunLayout(run)
    r0, rounds = keys.round(0), keys.rounds_dir
    dirs = (keys.shards_dir(0), keys.manifests_dir(0), keys.progress_dir(0))
    reserved = set(ROUND_FOLDERS)
    if peer in reserved:  # a peer folder named like a round's folder would fall under deny_writes
        raise ValueError(f"peer id {peer!r} is reserved (a round's folders: {', '.join(sorted(reserved))})")

    def any_round(key: str) -> str:
        if not key.startswith(r0 + "/"):  # the layout moved: fail loudly rather than grant the wrong keys
            raise AssertionError(f"{key!r} is not under {r0!r}")
        return f"{rounds}/*{key[len(r0):]}"

    def nested(key_dir: str) -> str:
        return f"{rounds}/*/*{key_dir[len(r0):]}/*"

    own_shard = keys.shard(0, peer, "*")  # chunks: rounds/R/shards/PEER/PART/NAME/...
    writes = (
        any_round(own_shard),
        any_round(keys.manifest(own_shard)),  # rounds/R/manifests/PEER/PART.json
        any_round(keys.progress(0, peer)),    # rounds/R/progress/PEER.json
        f"{keys.claims_dir}/*.json",          # claims/BLOCK.json (create-once)
    )
    deny = tuple(nested(d) for d in dirs)
    data_root = DataLayout(data).root if data else DataLayout.ROOT
    run_root, data_root = _join(prefix, keys.root), _join(prefix, data_root)
    return VolunteerKeys(
        reads=(f"{run_root}/*", f"{data_root}/*"),
        lists=(f"{run_root}/*", f"{data_root}/*"),
        writes=tuple(_join(prefix, k) for k in writes),
        deny_writes=tuple(_join(prefix, k) for k in deny),
        prefixes=(f"{run_root}/", f"{data_root}/"),
    )


def aws_policy(bucket: str, prefix: str, run: str, peer: str, data: str | None = None,
               partition: str = "aws") -> dict:
    """IAM policy document for one volunteer: read the run and the data sets, list below them,
    write its own keys, delete nothing.

    Use it as an STS session policy (``aws sts assume-role --policy``; the session gets the
    intersection with the role's own policy) or as an IAM user's policy. It stays well under
    IAM's 2,048-character limit for session and inline user policies with ordinary names.
    """
    _check_bucket(bucket)
    if partition not in ("aws", "aws-cn", "aws-us-gov"):
        raise ValueError(f"partition {partition!r} must be aws, aws-cn or aws-us-gov")
    k = volunteer_keys(prefix, run, peer, data)
    arn = f"arn:{partition}:s3:::{bucket}"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "ReadRunAndData", "Effect": "Allow", "Action": "s3:GetObject",
             "Resource": [f"{arn}/{p}" for p in k.reads]},
            {"Sid": "ListRunAndData", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": arn,
             "Condition": {"StringLike": {"s3:prefix": list(k.lists)}}},
            {"Sid": "WriteOwnKeys", "Effect": "Allow", "Action": "s3:PutObject",
             "Resource": [f"{arn}/{p}" for p in k.writes]},
            {"Sid": "NoKeysNestedInOtherFolders", "Effect": "Deny", "Action": "s3:PutObject",
             "Resource": [f"{arn}/{p}" for p in k.deny_writes]},
        ],
    }


def minio_policy(bucket: str, prefix: str, run: str, peer: str, data: str | None = None) -> dict:
    """The AWS document unchanged: MinIO's policy engine reads the AWS grammar (``arn:aws:s3:::``
    resources, ``*`` wildcards, ``StringLike`` on ``s3:prefix``, ``Deny``), both for
    ``mc admin policy create`` and as an inline policy of MinIO's STS AssumeRole."""
    return aws_policy(bucket, prefix, run, peer, data)


def r2_temp_credentials_request(bucket: str, prefix: str, run: str, peer: str, data: str | None = None,
                                parent_access_key_id: str = PARENT_KEY_PLACEHOLDER,
                                ttl_seconds: int = 86400) -> dict:
    """Body of ``POST /accounts/{account_id}/r2/temp-access-credentials`` for one volunteer.

    R2 cannot express this module's policy: a temporary credential has one permission for all of
    its ``prefixes`` and ``objects``, which are plain prefixes (no wildcard for the round), and the
    worker uses one credential for reading and writing. The closest single credential is
    ``object-read-write`` on the run and the data sets: the volunteer cannot reach other runs,
    other prefixes or other buckets, and the credential expires, but inside the run it could
    overwrite what only the organizer should write. Give R2 credentials to trusted volunteers
    only, or prefer S3 or MinIO (docs/security.md).
    """
    _check_bucket(bucket, r2=True)
    if not isinstance(parent_access_key_id, str) or not parent_access_key_id.strip():
        raise ValueError("parent_access_key_id must be the organizer's R2 access key id")
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= R2_MAX_TTL_S:
        raise ValueError(f"ttl_seconds {ttl_seconds!r} must be an integer in [1, {R2_MAX_TTL_S}] (R2's limit)")
    k = volunteer_keys(prefix, run, peer, data)
    return {
        "bucket": bucket,
        "parentAccessKeyId": parent_access_key_id,
        "permission": "object-read-write",
        "ttlSeconds": ttl_seconds,
        "prefixes": list(k.prefixes),
    }


def policy_for(bucket_url: str, run: str, peer: str, fmt: str, **options) -> dict:
    """What ``dedloc policy --bucket s3://B/PREFIX --run RUN --peer PEER --format FMT`` prints.

    ``options`` go to the format's function: ``data`` (narrow reads to one data set) for all,
    ``parent_access_key_id`` and ``ttl_seconds`` for ``r2``, ``partition`` for ``aws``.
    """
    bucket, prefix = parse_bucket_url(bucket_url)
    if fmt == "aws":
        return aws_policy(bucket, prefix, run, peer, **options)
    if fmt == "minio":
        return minio_policy(bucket, prefix, run, peer, **options)
    if fmt == "r2":
        return r2_temp_credentials_request(bucket, prefix, run, peer, **options)
    raise ValueError(f"format {fmt!r} must be one of {', '.join(FORMATS)}")
