"""Least-privilege bucket credentials for one volunteer (``dedloc policy``).

A volunteer writes only below its own prefix, ``runs/RUN/volunteers/PEER/``, which holds all it
writes: its heartbeats, its shards and their manifests. It reads the run and the data sets and
lists below them. Everything else in the run (run.json, ROSTER.json, VIEW.json, the states with
their COMMIT and LATEST, CLOSE, STOP, the frozen shards, the aggregators' scratch) is written by
the organizer alone, whose own credentials never leave the organizer's machines.

Every key pattern is derived from ``RunLayout``, so the policy follows the layout instead of
spelling keys a second time; ``tests/test_policy.py`` checks every key the layout can produce,
and keys an attacker would try, against these patterns.

Formats: ``aws`` (an IAM policy document: an STS session policy, or an IAM user's inline or
managed policy), ``minio`` (the same document: MinIO reads the AWS policy grammar and the
``s3:prefix`` condition) and ``r2`` (the bodies of Cloudflare R2's two temporary-credentials
requests: R2 scopes a credential to plain prefixes with a single permission, so a volunteer
holds a read-only one and a read-write one on its own prefix: ``r2_temp_credentials_request``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..storage.layout import PEER_ID, DataLayout, RunLayout, is_name

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
    """Key patterns, bucket-relative, in IAM's wildcards (``*`` any run of characters, '/'
    included), and the same as plain prefixes (R2's)."""

    reads: tuple[str, ...]     # GetObject
    lists: tuple[str, ...]     # s3:prefix values ListBucket accepts
    writes: str                # PutObject: the volunteer's own prefix, whole
    prefixes: tuple[str, ...]  # plain prefixes it reads (R2): the run and the data sets, '/'-terminated
    own: str                   # the plain prefix it writes (R2), '/'-terminated


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def volunteer_keys(prefix: str, run: str, peer: str, data: str | None = None) -> VolunteerKeys:
    """What peer ``peer`` of run ``run`` under bucket prefix ``prefix`` reads, lists and writes.

    Everything a volunteer writes lies under ``runs/RUN/volunteers/PEER/`` (``RunLayout``), so
    one grant confines it, the trailing '/' included (``volunteers/alice/`` does not match
    ``volunteers/alicebob/``). Inside it a volunteer may write any key: every reader takes only
    the keys the layout names (``RunLayout.written``), and counts them for the peer whose prefix
    they lie under, whatever they say.
    """
    _check_prefix(prefix)
    _check_name("run", run)
    _check_name("peer id", peer)
    if data is not None:
        _check_name("data set", data)
    keys = RunLayout(run)
    data_root = DataLayout(data).root if data else DataLayout.ROOT
    run_root, data_root = _join(prefix, keys.root), _join(prefix, data_root)
    own = _join(prefix, keys.volunteer_dir(peer)) + "/"
    return VolunteerKeys(
        reads=(f"{run_root}/*", f"{data_root}/*"),
        lists=(f"{run_root}/*", f"{data_root}/*"),
        writes=f"{own}*",
        prefixes=(f"{run_root}/", f"{data_root}/"),
        own=own,
    )


def aws_policy(bucket: str, prefix: str, run: str, peer: str, data: str | None = None,
               partition: str = "aws") -> dict:
    """IAM policy document for one volunteer: read the run and the data sets, list below them,
    write below its own prefix, delete nothing.

    Use it as an STS session policy (``aws sts assume-role --policy``; the session gets the
    intersection with the role's own policy) or as an IAM user's policy. It stays under
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
            {"Sid": "WriteOwnPrefix", "Effect": "Allow", "Action": "s3:PutObject",
             "Resource": f"{arn}/{k.writes}"},
        ],
    }


def minio_policy(bucket: str, prefix: str, run: str, peer: str, data: str | None = None) -> dict:
    """The AWS document unchanged: MinIO's policy engine reads the AWS grammar (``arn:aws:s3:::``
    resources, ``*`` and ``?`` wildcards, ``StringLike`` on ``s3:prefix``, ``Deny``), both for
    ``mc admin policy create`` and as an inline policy of MinIO's STS AssumeRole."""
    return aws_policy(bucket, prefix, run, peer, data)


def r2_temp_credentials_request(bucket: str, prefix: str, run: str, peer: str, data: str | None = None,
                                parent_access_key_id: str = PARENT_KEY_PLACEHOLDER,
                                ttl_seconds: int = 86400) -> dict:
    """Bodies of the two ``POST /accounts/{account_id}/r2/temp-access-credentials`` calls for one
    volunteer, ``read`` and ``write``: an R2 temporary credential has one permission for all of
    its prefixes, so the volunteer holds two, ``object-read-only`` on the run and the data sets
    and ``object-read-write`` on its own prefix, which holds everything it writes. The worker
    reads with the first and writes with the second (``dedloc worker --write-profile``);
    ``r2_notice`` says what the second still allows."""
    _check_bucket(bucket, r2=True)
    if not isinstance(parent_access_key_id, str) or not parent_access_key_id.strip():
        raise ValueError("parent_access_key_id must be the organizer's R2 access key id")
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= R2_MAX_TTL_S:
        raise ValueError(f"ttl_seconds {ttl_seconds!r} must be an integer in [1, {R2_MAX_TTL_S}] (R2's limit)")
    k = volunteer_keys(prefix, run, peer, data)

    def body(permission: str, prefixes: list[str]) -> dict:
        return {"bucket": bucket, "parentAccessKeyId": parent_access_key_id, "permission": permission,
                "ttlSeconds": ttl_seconds, "prefixes": prefixes}

    return {"read": body("object-read-only", list(k.prefixes)), "write": body("object-read-write", [k.own])}


R2_NOTICE = """\
Two credentials, both expiring after {ttl} s:
- "read": object-read-only on
{prefixes}
  (as on S3 and MinIO: the volunteer reads and lists the run and the data sets);
- "write": object-read-write on
  {own}
  and nothing else. The worker writes with it: `dedloc worker --write-profile PROFILE`, the AWS
  profile that holds it, beside the read credential in the usual AWS variables or profile.
R2 cannot make the write credential create-only, as S3 and MinIO policies do; in its own prefix
its holder can also overwrite and delete, and write keys the layout does not have. What the
protocol does with that:
- a shard rewritten or deleted after the scheduler validated it changes nothing: the scheduler
  validated a copy of it in the round's frozen/ folder, which only the organizer writes, and
  aggregators and the validator read that copy;
- a shard rewritten or deleted before that is rejected, its samples lost to its own volunteer;
- keys off the layout are never read, and pruned with the rounds; a prefix holding more objects
  than the rounds need is not read at all until it is pruned.
Everything else in the run, what only the organizer writes (run.json, ROSTER.json, VIEW.json,
STOP.json, the states, CLOSE, the validator's records) and the other volunteers' prefixes, is
read-only to this volunteer, as on S3 and MinIO (docs/security.md).
"""


def r2_notice(bucket_url: str, run: str, peer: str, data: str | None = None, ttl_seconds: int = 86400) -> str:
    """What ``dedloc policy --format r2`` prints beside the request bodies (on stderr): which
    credential is for what, and what the write one leaves its holder able to do."""
    bucket, prefix = parse_bucket_url(bucket_url)
    k = volunteer_keys(prefix, run, peer, data)
    return R2_NOTICE.format(prefixes="\n".join(f"  {bucket}/{p}" for p in k.prefixes), ttl=ttl_seconds,
                            own=f"{bucket}/{k.own}")


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
