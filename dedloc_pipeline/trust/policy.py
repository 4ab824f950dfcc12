"""Least-privilege bucket credentials for one volunteer (``dedloc policy``).

A volunteer writes only the keys the protocol has it write, under its own peer id: the objects
of its shards, their manifests and its heartbeats. It reads the run and the data sets and lists
below them. Everything else in the run (run.json, ROSTER.json, VIEW.json, the states with their
COMMIT and LATEST, CLOSE, STOP, the aggregators' scratch) is written by the organizer alone,
whose own credentials never leave the organizer's machines.

Every key pattern is derived from ``RunLayout`` and the codec's shard objects, so the policy
follows the layout instead of spelling keys a second time; ``tests/test_policy.py`` checks every
key the layout can produce, and keys an attacker would try, against these patterns.

Formats: ``aws`` (an IAM policy document: an STS session policy, or an IAM user's inline or
managed policy), ``minio`` (the same document: MinIO reads the AWS policy grammar, ``?``,
the ``s3:prefix`` condition and ``Deny`` included) and ``r2`` (the body of Cloudflare R2's
temporary-credentials request, which can scope a credential to prefixes but gives it a single
permission: see ``r2_temp_credentials_request`` and ``r2_notice``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..storage import part, vector
from ..storage.layout import PEER_ID, DataLayout, RunLayout, is_name, name_problem

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

# A shard's part name (storage/part.py) as IAM wildcards: one '?' per character of its fixed width.
PART = "?" * part.MS_DIGITS + "-" + "?" * part.TOKEN_HEX

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
    """Key patterns, bucket-relative, in IAM's wildcards: ``*`` any run of characters and ``?``
    any one character, '/' included in both."""

    reads: tuple[str, ...]        # GetObject
    lists: tuple[str, ...]        # s3:prefix values ListBucket accepts
    writes: tuple[str, ...]       # PutObject
    deny_writes: tuple[str, ...]  # PutObject refused even where `writes` matches
    prefixes: tuple[str, ...]     # plain prefixes (R2): the run and the data sets, '/'-terminated


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def shard_objects() -> tuple[str, ...]:
    """What a shard stores below its key, the array's name as ``*``: each array's one chunk
    object (a shard is written whole, its metadata the run's: ``vector.write_vector``,
    ``chunk_objects``).
    The names depend on the run's codec, which is in run.json; the policy does not read it, and
    naming every codec's arrays would take the document past IAM's 2,048 characters."""
    fmt = vector.VectorFormat("none", n=1, chunk_size=1, block=1, whole=True)
    objects = vector.chunk_objects(fmt)
    return tuple(sorted("*/" + obj.split("/", 1)[1] for obj in objects))


def volunteer_keys(prefix: str, run: str, peer: str, data: str | None = None) -> VolunteerKeys:
    """What peer ``peer`` of run ``run`` under bucket prefix ``prefix`` reads, lists and writes.

    A write grant spells its key whole, the peer's folder included (``shards/alice/`` does not
    match ``shards/alicebob/``), with ``?`` for each character of the two fields the layout
    varies at a fixed width: the round (8 digits) and the shard's part (``PART``). IAM's ``?``
    and ``*`` also match '/', which would move a key a folder deeper than the layout puts it, so
    ``deny_writes`` refuses every key with a '/' too many:

    - in the round (``rounds/0000/000/shards/PEER/...``): a folder between the round's and its
      ``shards``, ``manifests`` or ``progress``;
    - in a part or an array's name: more folders below the round's ``manifests`` or ``shards``
      than the layout's deepest key there, or as many but ending as a shallower key does.

    Without them a peer could write ``manifests/alice/1/../../bob/a-abcdef.json``, which the
    scheduler lists with the round's manifests and parses as bob's, or ``shards/alice/PART/..``
    keys that a path-normalizing copy of the bucket puts into another peer's folder.
    """
    _check_prefix(prefix)
    _check_name("run", run)
    _check_name("peer id", peer)
    if data is not None:
        _check_name("data set", data)
    if problem := name_problem(peer):  # a peer folder named like a round's folder would fall under deny_writes
        raise ValueError(problem)
    keys = RunLayout(run)
    r0, rounds = keys.round(0), keys.rounds_dir
    width = len(r0) - len(rounds) - 1

    def in_any_round(key: str) -> str:
        if not key.startswith(r0 + "/"):  # the layout moved: fail loudly rather than grant the wrong keys
            raise AssertionError(f"{key!r} is not under {r0!r}")
        return f"{rounds}/{'?' * width}{key[len(r0):]}"

    def deeper(folder: str, slashes: int, ending: str = "*") -> str:
        """Keys below the round's ``folder`` with ``slashes`` or more '/', ending in ``ending``."""
        return f"{rounds}/*/{folder[len(r0) + 1:]}/{'*/' * slashes}{ending}"

    own = keys.shard(0, peer, PART)  # rounds/R/shards/PEER/PART
    objects = shard_objects()  # */c/0
    deepest = max(obj.count("/") for obj in objects)
    shards, manifests = keys.shards_dir(0), keys.manifests_dir(0)
    writes = (
        *(in_any_round(f"{own}/{obj}") for obj in objects),
        in_any_round(keys.manifest(own)),  # rounds/R/manifests/PEER/PART.json
        in_any_round(keys.progress(0, peer)),  # rounds/R/progress/PEER.json
    )
    deny = (
        *(f"{rounds}/*/*/{d[len(r0) + 1:]}/*" for d in (shards, manifests, keys.progress_dir(0))),
        deeper(manifests, 2),  # PEER/PART.json: one '/'
        deeper(shards, deepest + 3),  # PEER/PART/ARRAY/c/0: deepest + 2
        *(deeper(shards, obj.count("/") + 3, obj.rsplit("/", 1)[-1])  # PEER/PART/ARRAY/zarr.json
          for obj in objects if obj.count("/") < deepest),
    )
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
            {"Sid": "WriteOwnKeys", "Effect": "Allow", "Action": "s3:PutObject",
             "Resource": [f"{arn}/{p}" for p in k.writes]},
            {"Sid": "NoFoldersTheLayoutLacks", "Effect": "Deny", "Action": "s3:PutObject",
             "Resource": [f"{arn}/{p}" for p in k.deny_writes]},
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
    """Body of ``POST /accounts/{account_id}/r2/temp-access-credentials`` for one volunteer.

    R2 cannot express this module's policy: a temporary credential has one permission for all of
    its ``prefixes`` and ``objects``, which are plain prefixes (no wildcard for the round), and the
    worker uses one credential for reading and writing. The closest single credential is
    ``object-read-write`` on the run and the data sets; ``r2_notice`` says what that leaves the
    volunteer able to do and which of it the protocol's checks catch.
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


R2_NOTICE = """\
R2 cannot scope a credential to the volunteer's own keys. This one is object-read-write on
every key under
{prefixes}
and on nothing else: no other run, prefix or bucket. It expires after {ttl} s.
Under those prefixes its holder can:
- read and list every object, as on S3 and MinIO;
- write any key, not only its own: other peers' shards, manifests and heartbeats, and what only
  the organizer writes: run.json, ROSTER.json, VIEW.json, STOP.json, the states (parameters,
  deltas, optimizer state, streams.json, COMMIT.json, LATEST.json), the rounds' CLOSE.json, the
  aggregators' reduced/ and applied/ objects, evaluations, exports, and the data sets (DATA.json
  and its shards) under {data}, which other runs may use too;
- overwrite or delete any object there.
The protocol's checks still catch:
- a changed chunk of a shard: it fails its checksum in the shard's manifest, and the shard is
  rejected (its samples are lost, not altered). The scheduler validates a copy of each shard in
  frozen/, which aggregators and the validator read: a rewrite after validation changes nothing,
  but this credential can write frozen/ too, and a frozen copy that fails its checksums stops
  the aggregator rather than be skipped or used;
- in a run with an organizer key, every manifest not signed by the enrolled, unrevoked key of the
  volunteer its peer id names: unsigned or edited manifests, manifests under another peer's name,
  and signed ones copied to another round or part (round, peer and part are signed and must match
  the manifest's key);
- keys off the layout: the scheduler takes shards only from the round's manifests folder, their
  round, peer and part from the key, and heartbeats only at the layout's heartbeat keys;
- an unsigned or edited ROSTER.json: it must be signed by the organizer key in run.json;
- a changed parameter or delta chunk, when a worker loads a state (the checksums in its
  COMMIT.json), and a changed data shard (the hashes in DATA.json);
- in a run with an organizer key, a COMMIT.json, CLOSE.json, LATEST.json, streams.json,
  VIEW.json or STOP.json (and the validator's verdicts and flags) not signed by it, or a signed
  one copied to another round, state, volunteer or run: every reader checks the signature and the
  place, and the scheduler deletes a forged CLOSE, COMMIT or STOP and writes the true one; a
  rewritten run.json (signed by the key it names; each volunteer pins the organizer's key on
  first join and refuses a run.json naming another, or none); a roster written back over a newer
  one, or newer versions deleted (the versions are kept create-once, and a scheduler refuses a
  history older than its newest CLOSE's); a rewritten DATA.json (run.json pins its hash).
Nothing catches:
- in a run without an organizer key, anything the organizer writes (run.json, VIEW.json,
  STOP.json, the states' records): none of it is signed;
- rewritten parameters, optimizer state or reduced gradients before an aggregator reads them
  (it reads them without checksums): they go into the next state;
- deletes: other peers' shards before CLOSE, the states, the data sets;
- in a run without an organizer key, a manifest under another peer's name: it counts as theirs.
Give R2 credentials only to volunteers you trust; for a public collaboration use S3 or MinIO
(docs/security.md).
"""


def r2_notice(bucket_url: str, run: str, peer: str, data: str | None = None, ttl_seconds: int = 86400) -> str:
    """What ``dedloc policy --format r2`` prints beside the request body (on stderr): what the
    credential leaves its holder able to do, and what the protocol's checks catch of it."""
    bucket, prefix = parse_bucket_url(bucket_url)
    k = volunteer_keys(prefix, run, peer, data)
    return R2_NOTICE.format(prefixes="\n".join(f"  {bucket}/{p}" for p in k.prefixes), ttl=ttl_seconds,
                            data=f"{bucket}/{k.prefixes[1]}")


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
