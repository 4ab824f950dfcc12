"""S3 through s3fs, in the fewest requests: the client's settings, and the calls where s3fs's
generic ones would send more (a conditional GET, a HEAD alone, one LIST a 1000 keys with their
ETags, batched deletes). The Bucket calls these when its URL is ``s3://``."""

from __future__ import annotations

import os
from collections.abc import Callable

from fsspec.asyn import sync

from .stats import IOStats, counted_session


def configure(options: dict, endpoint_url: str | None, timeout: float, stats: IOStats) -> None:
    """Fill in s3fs's options (those the caller set are kept): the endpoint (argument, else
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``), timeouts, and a session that counts
    every request in ``stats``."""
    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint_url:
        options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint_url
    options.setdefault("config_kwargs", {
        "connect_timeout": timeout, "read_timeout": timeout,
        "retries": {"max_attempts": 2, "mode": "standard"}})
    options.setdefault("use_listings_cache", False)
    options.setdefault("max_concurrency", 1)  # else every whole-object GET is a HEAD first
    options.setdefault("session", counted_session(stats, options.pop("profile", None)))


def get_if_changed(fs, path: str, tag: str | None, limit: int | None = None) -> tuple[bytes | None, str | None, bool]:
    """One GET with ``If-None-Match: tag`` (a 304 carries no body), of at most ``limit`` bytes:
    ``Fetched``'s fields, (bytes, ETag, True), (None, tag, False) if unchanged, or (None, None,
    True) if missing."""
    return sync(fs.loop, _get_if_changed, fs, path, tag, limit)


async def _get_if_changed(fs, path: str, tag: str | None, limit: int | None) -> tuple[bytes | None, str | None, bool]:
    bucket, name, _ = fs.split_path(path)
    options = {**({"IfNoneMatch": tag} if tag else {}), **({"Range": f"bytes=0-{limit - 1}"} if limit else {})}
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=name, **options)
    except FileNotFoundError:
        return None, None, True
    except OSError as exc:  # s3fs makes botocore's 304 an OSError
        code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
        if code == "304":
            return None, tag, False
        if code == "InvalidRange":  # a ranged GET of an empty object: S3 answers 416, not its no bytes
            return b"", None, True
        raise
    try:
        data = await resp["Body"].read()
    finally:
        resp["Body"].close()
    return data, resp.get("ETag"), True


def exists(fs, path: str) -> bool:
    """One HEAD (s3fs's ``exists`` would add a LIST for a missing key, probing for a directory)."""
    bucket, name, _ = fs.split_path(path)
    try:
        fs.call_s3("head_object", Bucket=bucket, Key=name)
    except FileNotFoundError:
        return False
    return True


def copy(fs, src: str, dst: str, etag: str | None = None) -> None:
    """One CopyObject, server-side (s3fs's ``copy`` sizes the source first: a HEAD and LISTs);
    FileNotFoundError if ``src`` is gone. Objects up to 5 GB: a shard is far smaller. ``etag``:
    only if what was copied has it (``CopySourceIfMatch``, and the copy's own ETag checked, as
    a store may not honour the condition), else FileNotFoundError too."""
    (sb, sk, _), (db, dk, _) = fs.split_path(src), fs.split_path(dst)
    try:
        got = sync(fs.loop, fs._call_s3, "copy_object", Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk},
                   **({"CopySourceIfMatch": etag} if etag else {}))
    except FileNotFoundError:
        raise
    except OSError as exc:  # 412: the source changed since it was listed
        if etag and ("412" in str(exc) or "PreconditionFailed" in str(exc)):
            raise FileNotFoundError(f"{src} changed since it was listed ({exc})") from exc
        raise
    if etag and str(got.get("CopyObjectResult", {}).get("ETag")) != etag:
        raise FileNotFoundError(f"{src} changed since it was listed: its copy has another ETag")


def objects(fs, path: str, after: Callable[[str], str | None] | None = None) -> dict[str, tuple[int, str]]:
    """Every object whose path starts with ``path``, with size and ETag: one LIST a 1000
    keys (s3fs's ``find`` adds a HEAD and a second LIST when there are none). ``after``: given
    each key listed, less ``path`` (which ends in '/'), None, or a key (less ``path``) to go on
    after (``StartAfter``): a listing skips what its reader does not need."""
    bucket, name, _ = fs.split_path(path)
    found, token, start = {}, None, None
    while True:
        more = {"ContinuationToken": token} if token else {"StartAfter": start} if start else {}
        resp = sync(fs.loop, fs._call_s3, "list_objects_v2", Bucket=bucket, Prefix=name, **more)
        start = None
        for o in resp.get("Contents", []):
            found[f"{bucket}/{o['Key']}"] = (int(o["Size"]), str(o["ETag"]))
            if after is not None and (skip := after(o["Key"][len(name):])) is not None:
                start = name + skip
                break
        token = resp.get("NextContinuationToken")
        if start is not None:
            token = None
        elif not (resp.get("IsTruncated") and token):
            return found


def delete(fs, path: str, kept: Callable[[str], bool] = lambda k: False) -> None:
    """The object ``path`` and everything below it but the paths ``kept`` says: one LIST, and
    one DeleteObjects a 1000 keys only if there is anything (a pruned prefix costs one LIST)."""
    keys = [k for k in objects(fs, path) if (k == path or k.startswith(path + "/")) and not kept(k)]
    bucket = fs.split_path(path)[0]
    for i in range(0, len(keys), 1000):
        sync(fs.loop, fs._call_s3, "delete_objects", Bucket=bucket, Delete={
            "Objects": [{"Key": fs.split_path(k)[1]} for k in keys[i:i + 1000]], "Quiet": True})
