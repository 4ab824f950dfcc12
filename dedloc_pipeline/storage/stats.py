"""What one process's traffic with a bucket was: requests by the price class they are billed in,
and the bytes they moved (benchmarks, heartbeats and the cost estimate report these)."""

from __future__ import annotations

import threading
from collections import Counter

# S3 operations by the price class they are billed in ("list" and "put" cost ~12x "get")
_REQUEST_KINDS = {"GetObject": "get", "GetBucketLocation": "get", "HeadObject": "head", "HeadBucket": "head",
                  "ListObjectsV2": "list", "ListObjects": "list", "PutObject": "put", "CreateBucket": "put",
                  "CopyObject": "put", "CreateMultipartUpload": "put", "UploadPart": "put",
                  "CompleteMultipartUpload": "put", "DeleteObject": "delete", "DeleteObjects": "delete"}


class IOStats:
    """Requests and bytes this process exchanged with one bucket.

    On S3 every request is counted where botocore sends it (each retry too), so the counts equal
    what the server bills; elsewhere, where the Bucket and its zarr stores make their calls.
    Bytes are the payloads those calls moved.
    """

    def __init__(self, sent_by_client: bool = False):
        self._lock = threading.Lock()
        self.sent_by_client = sent_by_client
        self.requests: Counter[str] = Counter()  # get, put, head, list, delete
        self.bytes_read = 0
        self.bytes_written = 0

    def add(self, kind: str, read: int = 0, written: int = 0, n: int = 1) -> None:
        with self._lock:
            if not self.sent_by_client:
                self.requests[kind] += n
            self.bytes_read += read
            self.bytes_written += written

    def sent(self, request=None, event_name: str = "", **_) -> None:
        """botocore's ``before-send`` hook: one request on the wire."""
        kind = _REQUEST_KINDS.get(event_name.rsplit(".", 1)[-1], (request.method if request else "other").lower())
        with self._lock:
            self.requests[kind] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "bytes_read": self.bytes_read,
                    "bytes_written": self.bytes_written}


def counted_session(stats: IOStats, profile: str | None = None):
    """An aiobotocore session (of AWS profile ``profile``, if given) whose clients report every
    request they send to ``stats``: the Bucket's own filesystem and its zarr stores' (built from
    the same options) share it."""
    from aiobotocore.session import AioSession

    session = AioSession(profile=profile)
    session.register("before-send.s3", stats.sent)
    return session
