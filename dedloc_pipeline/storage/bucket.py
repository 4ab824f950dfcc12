"""The bucket: the only shared state. Any fsspec URL, retried with backoff, markers written last.

A reader trusts only markers, so plain writes only need to be whole when they land: local
files are written to a temporary name and renamed; S3 PUTs are atomic by nature. Markers that
must exist at most once (CLOSE, COMMIT) are created with ``create``: ``If-None-Match: *`` on
S3, a hard link on local disks.

Every request, the Bucket's own and its zarr stores' chunk I/O, goes through one retry policy:
a request that fails or times out is tried again, and since a reply can be lost after the
request took effect, every write is safe to repeat (``create`` included: finding its own bytes
already there counts as created). Which errors are retried is ``retry``'s; the S3 requests that
replace s3fs's generic calls are ``s3``'s, a disk's whole writes and walks ``local``'s; what the
traffic was, ``stats``'.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import fsspec
import zarr
from tenacity import AsyncRetrying, Retrying

from . import local, s3
from .retry import RetryPolicy, transient
from .stats import IOStats


class Damaged(ValueError):
    """A record in the bucket that cannot be read as what it is: a truncated or overwritten JSON
    file. The message names its key, so the organizer knows what to restore or repair; ``key``
    is that key, so a command can say whether `dedloc repair` sees it."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key

    def __reduce__(self):  # to another process (a Prefect or Dask task's) with its key
        return type(self), (str(self), self.key)


class StorageError(RuntimeError):
    """The bucket did not answer after the retries."""


def _gave_up(bucket: "Bucket", exc: Exception) -> Exception:
    explained = _explained(bucket, exc)
    if explained is not None:
        return explained
    return StorageError(f"bucket {bucket.url} unreachable: {exc}") if transient(exc) else exc


def _explained(bucket: "Bucket", exc: Exception) -> StorageError | None:
    """A mistake of the user's, in one line that names it and the fix: no credentials, an AWS
    profile that is not there, a bucket that does not exist (botocore's and s3fs's words name
    none of the three)."""
    kind = type(exc).__name__
    if kind == "NoCredentialsError":
        return StorageError(f"no credentials for {bucket.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                            "(the organizer gives them), or AWS_PROFILE")
    if kind == "ProfileNotFound":
        return StorageError(f"bucket {bucket.url}: {exc} (a profile of ~/.aws/credentials or ~/.aws/config, "
                            "as --write-profile, DEDLOC_WRITE_PROFILE or AWS_PROFILE name it)")
    if bucket.protocol == "s3" and "bucket does not exist" in str(exc):
        return StorageError(bucket.missing() or f"bucket {bucket.url}: {exc}")
    return None


def check_url(url: str) -> None:
    """A bucket URL the user may have mistyped is refused, not taken as a local folder's name:
    ``s3:collab`` or ``s3:`` (no ``//``), and ``s3://`` with no bucket."""
    scheme, sep, rest = url.partition("://")
    if sep and not rest.strip("/"):
        raise StorageError(f"bucket URL {url!r} names no bucket: {scheme}://BUCKET/PREFIX")
    if not sep and re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", url):  # a Windows drive letter is one letter
        name, _, path = url.partition(":")
        raise StorageError(f"bucket URL {url!r} is not one: {name}://{path.lstrip('/') or 'BUCKET'}? "
                           "(s3://BUCKET/PREFIX, a folder's path or file://PATH, memory://NAME)")


def _retried(fn):
    """Retry transient storage errors with the bucket's policy; then a StorageError."""

    @functools.wraps(fn)
    def wrapper(self, *a, **kw):
        try:
            return Retrying(**self.retry.tenacity())(fn, self, *a, **kw)
        except Exception as exc:
            err = _gave_up(self, exc)
            if err is exc:
                raise
            raise err from exc

    return wrapper


def _routed(fn):
    """A write, by the bucket that writes its key (``confine_writes``), with that one's retries."""

    @functools.wraps(fn)
    def wrapper(self, key, *a, **kw):
        writer = self._writer
        return fn(writer[1] if writer is not None and key.startswith(writer[0]) else self, key, *a, **kw)

    return wrapper


def _per_folder(n: int) -> Callable[[str], str | None]:
    """A listing's bound of ``n`` keys, and one more (which says it has more), of each folder
    just below its prefix: given each key it lists, in key order and less the prefix, the key to
    go on after once that key's folder is full: FOLDER0, which every key of the folder sorts
    before ('/' < '0'), so one folder full of objects costs no more than its share."""
    seen: Counter[str] = Counter()

    def after(rest: str) -> str | None:
        folder = rest.split("/", 1)[0]
        seen[folder] += 1
        return f"{folder}0" if seen[folder] > n else None

    return after


@dataclass(frozen=True)
class Fetched:
    """A conditional read: the object's bytes and version tag, or ``changed=False`` (bytes None)
    when it still has the tag the reader gave."""

    data: bytes | None
    tag: str | None
    changed: bool = True


class _BucketStore(zarr.storage.WrapperStore):
    """A bucket's zarr store: chunk I/O retried like the Bucket's own calls, and counted."""

    def __init__(self, store, bucket: "Bucket"):
        super().__init__(store)
        self.bucket = bucket

    def _with_store(self, store):
        return type(self)(store, self.bucket)

    async def _call(self, fn, *args):
        try:
            return await AsyncRetrying(**self.bucket.retry.tenacity())(fn, *args)
        except Exception as exc:
            raise _gave_up(self.bucket, exc) from exc

    async def get(self, key, prototype, byte_range=None):
        buf = await self._call(self._store.get, key, prototype, byte_range)
        self.bucket.stats.add("get", read=0 if buf is None else len(buf))
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        bufs = await self._call(self._store.get_partial_values, prototype, key_ranges)
        self.bucket.stats.add("get", read=sum(len(b) for b in bufs if b is not None), n=len(bufs))
        return bufs

    async def set(self, key, value):
        await self._call(self._store.set, key, value)
        self.bucket.stats.add("put", written=len(value))

    async def exists(self, key):
        self.bucket.stats.add("head")
        return await self._call(self._store.exists, key)

    async def delete(self, key):
        self.bucket.stats.add("delete")
        return await self._call(self._store.delete, key)


class Bucket:
    """One bucket URL (``file://``, a plain path, ``s3://``, ``memory://``)."""

    def __init__(self, url: str, endpoint_url: str | None = None, storage_options: dict | None = None,
                 timeout: float = 30.0, retry: RetryPolicy = RetryPolicy(), stats: IOStats | None = None,
                 create: bool = True):
        """``create``: a local bucket's folder is made if missing (False: readers and volunteers,
        for whom a missing folder is a mistyped path, told by ``missing``)."""
        check_url(url)
        self.url, self.retry, self._args = url.rstrip("/"), retry, (endpoint_url, timeout)
        self._writer: tuple[str, Bucket] | None = None  # confine_writes
        protocol, _, rest = self.url.partition("://")
        if not rest:
            protocol, rest = "file", os.path.abspath(self.url)
        self.protocol = protocol
        self.local = protocol == "file"
        self.given = dict(storage_options or {})  # as the caller gave them; ``options`` gains the client's hooks
        self.options = dict(self.given)
        self.stats = IOStats(sent_by_client=protocol == "s3") if stats is None else stats
        if protocol == "s3":
            s3.configure(self.options, endpoint_url, timeout, self.stats)
        try:
            self.fs = fsspec.filesystem(protocol, skip_instance_cache=protocol != "memory", **self.options)
        except (ImportError, ValueError) as exc:  # gs:// without gcsfs, or no such protocol at all
            raise StorageError(f"bucket {url}: {protocol}:// is not usable here ({exc}); s3:// works with any "
                               "S3-compatible store (--endpoint-url for R2, MinIO, or Google Cloud Storage's "
                               "XML API), file:// and plain paths with a folder") from exc
        self.root = rest if self.local else self.fs._strip_protocol(self.url)
        if self.local and create:
            self.fs.makedirs(self.root, exist_ok=True)

    def missing(self) -> str | None:
        """What is missing of the bucket itself, in one line: its folder (a mistyped path), or on
        S3 the bucket at its endpoint; None when it is there (one request)."""
        if self.local:
            return None if os.path.isdir(self.root) else \
                f"no folder {self.root} (a mistyped path? `dedloc init` makes a run's folder)"
        if self.protocol != "s3":
            return None
        name = self.root.split("/")[0]
        try:
            there = self.fs.exists(name)
        except Exception:  # unreachable, no credentials: the next request says so
            return None
        endpoint = self._args[0] or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return None if there else (f"no bucket {name!r} at {endpoint or 'AWS S3'}: a mistyped name, or "
                                   "--endpoint-url / AWS_ENDPOINT_URL not the store's")

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def __reduce__(self):
        """The same bucket in another process (a pool's worker), with counters of its own. One
        whose writes are confined to other credentials (``confine_writes``) stays where it is."""
        if self._writer is not None:
            raise TypeError(f"{self!r} writes with a second credential: it is not sent to other processes")
        return Bucket, (self.url, self._args[0], self.given, self._args[1], self.retry, None, False)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def confine_writes(self, prefix: str, storage_options: dict) -> None:
        """Write the keys below ``prefix`` with other credentials (``storage_options``, e.g.
        ``{"profile": NAME}``): a volunteer on R2 holds a read-only credential on the run and a
        read-write one on its own prefix (trust/policy.py). Reads keep this bucket's."""
        writer = Bucket(self.url, *self._args[:1], storage_options, self._args[1], self.retry, self.stats)
        self._writer = (prefix.rstrip("/") + "/", writer)

    # reads
    @_retried
    def read_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        try:
            data = self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            self.stats.add("get")
            return None
        self.stats.add("get", read=len(data))
        return data

    @_retried
    def read_if_changed(self, key: str, tag: str | None, limit: int | None = None) -> Fetched:
        """The object unless it still has version ``tag``: one conditional GET on S3
        (``If-None-Match``: a 304 carries no body), a stat on a local disk. A missing object
        reads as ``Fetched(None, None)``. ``limit``: at most that many bytes are fetched (a
        ranged GET), so an object larger than the caller accepts costs no more than that."""
        self.stats.add("get")
        fetch = s3.get_if_changed if self.protocol == "s3" else local.get_if_changed
        got = Fetched(*fetch(self.fs, self.path(key), tag, limit))
        if got.data is not None:
            self.stats.add("get", read=len(got.data), n=0)
        return got

    def read_json(self, key: str) -> Any:
        """Parsed JSON or None if missing; malformed JSON raises ``Damaged``, naming the key."""
        data = self.read_bytes(key)
        return None if data is None else self.parsed(key, data)

    def parsed(self, key: str, data: bytes) -> Any:
        """``data``, read from ``key``, as JSON; ``Damaged`` naming the key if it is not."""
        try:
            return json.loads(data)
        except ValueError as exc:  # UnicodeDecodeError too
            raise Damaged(f"{self.url}/{key} is damaged: not JSON ({exc})", key) from exc

    @_retried
    def read_many(self, keys: list[str]) -> dict[str, bytes | None]:
        """Several small objects in one batch (concurrent on S3)."""
        if not keys:
            return {}
        out = self.fs.cat([self.path(k) for k in keys], on_error="return")
        self.stats.add("get", read=sum(len(v) for v in out.values() if isinstance(v, bytes)), n=len(keys))
        res = {}
        for k in keys:
            v = out.get(self.path(k))
            if isinstance(v, FileNotFoundError):
                v = None
            elif isinstance(v, BaseException):
                raise v
            res[k] = v
        return res

    @_retried
    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (on S3: one HEAD)."""
        self.stats.add("head")
        if self.protocol == "s3":
            return s3.exists(self.fs, self.path(key))
        return self.fs.exists(self.path(key))

    @_retried
    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (sorted); empty if it does not exist."""
        self.stats.add("list")
        try:
            entries = self.fs.ls(self.path(prefix), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def find(self, prefix: str) -> list[str]:
        """Every key below ``prefix``, relative to the bucket root."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every key below ``prefix`` and its size in bytes (S3 lists them together)."""
        return {k: size for k, (size, _) in self.listing(prefix).items()}

    @_retried
    def listing(self, prefix: str, per_folder: int | None = None) -> dict[str, tuple[int, str | None]]:
        """Every key below ``prefix`` with its size and version tag (``Fetched.tag``): S3 lists
        the ETag with each key, so a reader can skip the objects it has read already.
        ``per_folder``: at most that many keys, and one more, of each folder just below
        ``prefix`` (``_per_folder``), in key order."""
        path, after = self.path(prefix), None if per_folder is None else _per_folder(per_folder)
        if self.protocol == "s3":
            found = s3.objects(self.fs, path + "/", after)
        else:
            found = local.objects(self.fs, path, self.stats, after)
        return {p[len(self.root) + 1:]: info for p, info in found.items()}

    # writes
    @_routed
    @_retried
    def write_bytes(self, key: str, data: bytes) -> None:
        self.stats.add("put", written=len(data))
        if self.local:
            local.write(self.fs, self.path(key), data)
        else:
            self.fs.pipe_file(self.path(key), data)

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, _dumps(obj))

    @_retried
    def copy(self, src: str, dst: str, fingerprint: str | None = None) -> None:
        """Copy object ``src`` to ``dst``: on S3 server-side (one CopyObject, billed as a PUT, no
        bytes through this machine); elsewhere whole (on a disk renamed into place).
        FileNotFoundError if ``src`` is gone, or no longer has ``fingerprint`` (``fingerprints``)."""
        self.stats.add("put")
        if self.protocol == "s3":
            s3.copy(self.fs, self.path(src), self.path(dst), fingerprint)
            return
        data = self.fs.cat_file(self.path(src))
        if fingerprint is not None and _md5(data) != fingerprint:
            raise FileNotFoundError(f"{src} changed since its fingerprint was taken")
        if self.local:
            local.write(self.fs, self.path(dst), data)
        else:
            self.fs.pipe_file(self.path(dst), data)

    def fingerprints(self, listed: dict[str, tuple[int, str | None]]) -> dict[str, str]:
        """A hash of each listed object's bytes that the store computed where it can: S3's ETag
        (the MD5 of a single-part upload's bytes: what the uploader sent cannot choose it), taken
        from the listing at no request; elsewhere the MD5 of the bytes, read here (a disk's)."""
        if self.protocol == "s3":
            return {k: str(tag) for k, (_, tag) in listed.items()}
        found = self.read_many(list(listed))
        return {k: _md5(v) for k, v in found.items() if v is not None}

    @_routed
    @_retried
    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist yet. True if this call created it, or an
        earlier attempt of it did (the same bytes are there: its reply was lost)."""
        path = self.path(key)
        self.stats.add("put", written=len(data))
        try:
            if self.local:
                local.create(self.fs, path, data)
            elif self.protocol == "memory":
                if self.fs.exists(path):
                    raise FileExistsError(path)
                self.fs.pipe_file(path, data)
            else:
                self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            self.stats.add("get")
            return self.fs.cat_file(path) == data

    def create_json(self, key: str, obj: Any) -> bool:
        return self.create(key, _dumps(obj))

    @_routed
    @_retried
    def delete(self, prefix: str, keep: Collection[str] = (), only: Callable[[str], bool] | None = None) -> None:
        """Delete the object ``prefix`` and everything below it but the keys ``keep`` and what
        lies below them, and with ``only``, but the keys it says False of: one listing, however
        many folders (on S3 in batches: ``s3.delete``; elsewhere ``local.delete``)."""
        self.stats.add("delete")
        tops, n = tuple(self.path(k) for k in keep), len(self.root) + 1

        def kept(path: str) -> bool:
            return any(path == t or path.startswith(t + "/") for t in tops) or (only is not None and not only(path[n:]))

        if self.protocol == "s3":
            s3.delete(self.fs, self.path(prefix), kept)
        else:
            local.delete(self.fs, self.path(prefix), kept if tops or only is not None else None,
                         Retrying(**self.retry.tenacity()))

    # arrays
    @_routed
    def zarr_store(self, key: str):
        """A zarr store rooted at ``key``, retried and counted."""
        return _BucketStore(self._store(key), self)

    def _store(self, key: str):
        """The backend's own store (zarr 3 needs an async filesystem for remote URLs)."""
        if self.local:
            return zarr.storage.LocalStore(self.path(key))
        return zarr.storage.FsspecStore.from_url(f"{self.protocol}://{self.path(key)}",
                                                 storage_options=self.options or None)


def _md5(data: bytes) -> str:
    """S3's ETag of a single-part upload of ``data``."""
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
