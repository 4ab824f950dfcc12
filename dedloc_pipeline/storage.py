"""The bucket: the only shared state. Any fsspec URL, retried with backoff, markers written last.

A reader trusts only markers, so plain writes only need to be whole when they land: local
files are written to a temporary name and renamed; S3 PUTs are atomic by nature. Markers that
must exist at most once (CLOSE, COMMIT) are created with ``create``: ``If-None-Match: *`` on
S3, a hard link on local disks.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import threading
import uuid
from collections import Counter
from typing import Any

import fsspec
import zarr
from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

log = logging.getLogger(__name__)

_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
              NotADirectoryError, ValueError, TypeError, KeyError)


try:  # botocore's network errors are not OSErrors
    from botocore.exceptions import ConnectionError as _BotoConnection, HTTPClientError as _BotoHTTP
    _NETWORK: tuple = (_BotoConnection, _BotoHTTP)
except ImportError:  # pragma: no cover - s3fs brings botocore
    _NETWORK = ()


class StorageError(RuntimeError):
    """The bucket did not answer after the retries."""


class IOStats:
    """Requests and bytes this process exchanged with one bucket, counted where the calls are
    made (the Bucket and its zarr stores): the traffic benchmarks and heartbeats report."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # get, put, head, list, delete
        self.bytes_read = 0
        self.bytes_written = 0

    def add(self, kind: str, read: int = 0, written: int = 0, n: int = 1) -> None:
        with self._lock:
            self.requests[kind] += n
            self.bytes_read += read
            self.bytes_written += written

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "bytes_read": self.bytes_read,
                    "bytes_written": self.bytes_written}


class _CountingStore(zarr.storage.WrapperStore):
    """A zarr store that adds its requests and bytes to an IOStats."""

    def __init__(self, store, stats: IOStats):
        super().__init__(store)
        self.stats = stats

    def _with_store(self, store):
        return type(self)(store, self.stats)

    async def get(self, key, prototype, byte_range=None):
        buf = await self._store.get(key, prototype, byte_range)
        self.stats.add("get", read=0 if buf is None else len(buf))
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        self.stats.add("get", read=sum(len(b) for b in bufs if b is not None), n=len(bufs))
        return bufs

    async def set(self, key, value):
        await self._store.set(key, value)
        self.stats.add("put", written=len(value))

    async def exists(self, key):
        self.stats.add("head")
        return await self._store.exists(key)

    async def delete(self, key):
        self.stats.add("delete")
        return await self._store.delete(key)


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _NETWORK):
        return True
    return isinstance(exc, (OSError, TimeoutError, ConnectionError)) and not isinstance(exc, _PERMANENT)


def _retried(fn):
    """Retry transient storage errors with exponential backoff, bounded in attempts and time."""
    inner = retry(
        retry=retry_if_exception(_transient),
        wait=wait_exponential(multiplier=0.2, max=5),
        stop=stop_after_attempt(6) | stop_after_delay(60),
        before_sleep=before_sleep_log(log, logging.WARNING),
        reraise=True,
    )(fn)

    @functools.wraps(fn)
    def wrapper(self, *a, **kw):
        try:
            return inner(self, *a, **kw)
        except Exception as exc:
            if _transient(exc):
                raise StorageError(f"bucket {self.url} unreachable: {exc}") from exc
            raise

    return wrapper


class Bucket:
    """One bucket URL (``file://``, a plain path, ``s3://``, ``memory://``)."""

    def __init__(self, url: str, endpoint_url: str | None = None, storage_options: dict | None = None,
                 timeout: float = 30.0):
        self.url = url.rstrip("/")
        protocol, _, rest = self.url.partition("://")
        if not rest:
            protocol, rest = "file", os.path.abspath(self.url)
        self.protocol = protocol
        self.local = protocol == "file"
        self.options = dict(storage_options or {})
        if protocol == "s3":
            endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL")
            if endpoint_url:
                self.options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint_url
            self.options.setdefault("config_kwargs", {
                "connect_timeout": timeout, "read_timeout": timeout,
                "retries": {"max_attempts": 2, "mode": "standard"}})
            self.options.setdefault("use_listings_cache", False)
        self.fs = fsspec.filesystem(protocol, skip_instance_cache=protocol != "memory", **self.options)
        self.root = rest if self.local else self.fs._strip_protocol(self.url)
        self.stats = IOStats()
        if self.local:
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

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

    def read_json(self, key: str) -> Any:
        """Parsed JSON or None if missing; malformed JSON raises ValueError."""
        data = self.read_bytes(key)
        return None if data is None else json.loads(data)

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
        self.stats.add("head")
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

    @_retried
    def find(self, prefix: str) -> list[str]:
        """Every key below ``prefix``, relative to the bucket root."""
        n = len(self.root) + 1
        try:
            found = sorted(p[n:] for p in self.fs.find(self.path(prefix)))
        except FileNotFoundError:
            found = []
        self.stats.add("list", n=1 + len(found) // 1000)  # S3 lists 1000 keys a request
        return found

    # writes
    @_retried
    def write_bytes(self, key: str, data: bytes) -> None:
        path = self.path(key)
        self.stats.add("put", written=len(data))
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        tmp = self._local_tmp(path, data)
        os.replace(tmp, path)

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, _dumps(obj))

    @_retried
    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist yet. True if this call created it."""
        path = self.path(key)
        self.stats.add("put", written=len(data))
        if self.local:
            tmp = self._local_tmp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.protocol == "memory":
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False

    def create_json(self, key: str, obj: Any) -> bool:
        return self.create(key, _dumps(obj))

    @_retried
    def delete(self, prefix: str) -> None:
        self.stats.add("delete")
        try:
            self.fs.rm(self.path(prefix), recursive=True)
        except FileNotFoundError:
            pass

    def _local_tmp(self, path: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{uuid.uuid4().hex[:8]}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return tmp

    # arrays
    def zarr_store(self, key: str):
        """A zarr store rooted at ``key`` (zarr 3 needs an async filesystem for remote URLs)."""
        if self.local:
            store = zarr.storage.LocalStore(self.path(key))
        else:
            store = zarr.storage.FsspecStore.from_url(f"{self.protocol}://{self.path(key)}",
                                                      storage_options=self.options or None)
        return _CountingStore(store, self.stats)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
