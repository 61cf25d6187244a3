"""Retries with backoff for S3 calls, and the one place botocore errors become ours.

Two layers, on purpose. botocore's own ``standard`` retry mode (``sdk_attempts`` per call)
absorbs the brief blips it knows about, with its timeouts from ``connect_timeout`` and
``read_timeout``. Around it, ``call`` retries what may pass with time (throttling, 5xx,
timeouts, refused connections, 409 ``ConditionalRequestConflict``) ``attempts`` times with
capped exponential backoff and full jitter, then raises ``TemporaryError``: the caller may try
again later. Everything else is mapped at once and never retried: a missing key or upload
(``NotFoundError``), a lost ``If-None-Match`` (``PreconditionFailed``), bytes that do not match
(``IntegrityError``), and credentials, permissions or a missing bucket (``StoreError``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from weightship.backoff import Backoff
from weightship.errors import (
    IntegrityError,
    NotFoundError,
    PreconditionFailed,
    StoreError,
    TemporaryError,
    WeightshipError,
)
from weightship.logs import event

__all__ = ["RetryPolicy", "call", "map_error"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_RETRYABLE_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})
_INTEGRITY_CODES = frozenset(
    {
        "BadDigest",
        "InvalidDigest",
        "XAmzContentSHA256Mismatch",
        "InvalidChecksum",
        "InvalidPart",
        "InvalidPartOrder",
        "EntityTooSmall",
    }
)
_ACCESS_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "ExpiredToken", "403"}
)
_TRANSIENT_EXCEPTIONS = (
    EndpointConnectionError,
    ConnectTimeoutError,
    ReadTimeoutError,
    ConnectionClosedError,
    ResponseStreamingError,
    HTTPClientError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try an S3 call before giving up; ``sleep`` is injectable for tests."""

    attempts: int = 3
    sdk_attempts: int = 2
    base_delay: float = 0.25
    max_delay: float = 8.0
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)

    def botocore_config(self, path_style: bool) -> Config:
        """The botocore client configuration: timeouts, its own retries, SigV4."""
        return Config(
            signature_version="s3v4",
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"mode": "standard", "total_max_attempts": max(1, self.sdk_attempts)},
            s3={"addressing_style": "path" if path_style else "auto"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )

    def backoff(self) -> Backoff:
        """The retry engine for this policy: capped exponential, full jitter."""
        return Backoff(self.attempts, self.base_delay, self.max_delay, sleep=self.sleep, jitter_floor=0.0)


def _classify(exc: Exception, what: str) -> tuple[WeightshipError, bool]:
    """Our error for a botocore failure of ``what``, and whether retrying may help."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        message = str(error.get("Message", "")) or code
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _RETRYABLE_CODES or status >= 500 or status == 429:
            return TemporaryError(f"{what} failed: S3 answered {status} {code}: {message}"), True
        if code in _NOT_FOUND_CODES or status == 404:
            if code == "NoSuchBucket":
                return StoreError(f"{what}: the bucket does not exist; create it or fix the store URL"), False
            return NotFoundError(f"{what}: not found ({code})"), False
        if code == "PreconditionFailed" or status == 412:
            return PreconditionFailed(f"{what}: the object already exists"), False
        if code in _INTEGRITY_CODES:
            return IntegrityError(f"{what}: S3 refused the bytes ({code}: {message})"), False
        if code in _ACCESS_CODES or status == 403:
            return StoreError(
                f"{what}: access denied ({code}: {message}); check the credentials and the bucket policy"
            ), False
        return StoreError(f"{what} failed: S3 answered {status} {code}: {message}"), False
    if isinstance(exc, NoCredentialsError):
        return StoreError(
            f"{what}: no S3 credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a role"
        ), False
    if isinstance(exc, _TRANSIENT_EXCEPTIONS):
        return TemporaryError(f"{what} failed: {type(exc).__name__}: {exc}"), True
    return StoreError(f"{what} failed: {type(exc).__name__}: {exc}"), False


def map_error(exc: Exception, what: str) -> WeightshipError:
    """Our error for a botocore failure of ``what`` (no retry)."""
    return _classify(exc, what)[0]


class _Transient(TemporaryError):
    """A failure of one S3 call that may pass: retried; no server hint (botocore's own retries took it)."""


def call(policy: RetryPolicy, what: str, fn: Callable[[], _T]) -> _T:
    """``fn()``, retried per ``policy`` while it fails in a way that may pass; errors mapped."""

    def once() -> _T:
        try:
            return fn()
        except (BotoCoreError, ClientError) as exc:
            error, retryable = _classify(exc, what)
        if not retryable:
            raise error from None
        raise _Transient(error.message, delay=0.0) from None

    def retrying(attempt: int, pause: float, error: WeightshipError) -> None:
        event(log, "s3.retry", what=what, attempt=attempt, delay=f"{pause:.3f}", error=error.message)

    try:
        return policy.backoff().run(once, on_retry=retrying)
    except _Transient as error:
        event(log, "s3.gave_up", logging.WARNING, what=what, attempts=policy.attempts, error=error.message)
        raise TemporaryError(
            f"{error.message}; gave up after {policy.attempts} attempts: check that the S3 endpoint is reachable "
            "and healthy, then retry",
            delay=policy.max_delay,
        ) from None
