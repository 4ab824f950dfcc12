"""Which storage errors are worth another try, and for how long: the one policy every bucket
request (the Bucket's own and its zarr stores' chunk I/O) is retried with."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tenacity import before_sleep_log, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

log = logging.getLogger(__name__)

_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
              NotADirectoryError, ValueError, TypeError, KeyError)


try:  # botocore's network errors are not OSErrors
    from botocore.exceptions import ConnectionError as _BotoConnection, HTTPClientError as _BotoHTTP
    _NETWORK: tuple = (_BotoConnection, _BotoHTTP)
except ImportError:  # pragma: no cover - s3fs brings botocore
    _NETWORK = ()


def transient(exc: BaseException) -> bool:
    """A network error or a timeout: the same request may well succeed again."""
    if isinstance(exc, _NETWORK):
        return True
    return isinstance(exc, (OSError, TimeoutError, ConnectionError)) and not isinstance(exc, _PERMANENT)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff, bounded in attempts and in time."""

    attempts: int = 6
    wait_s: float = 0.2
    max_wait_s: float = 5.0
    deadline_s: float = 60.0

    def tenacity(self) -> dict:
        return dict(retry=retry_if_exception(transient),
                    wait=wait_exponential(multiplier=self.wait_s, max=self.max_wait_s),
                    stop=stop_after_attempt(self.attempts) | stop_after_delay(self.deadline_s),
                    before_sleep=before_sleep_log(log, logging.WARNING), reraise=True)
