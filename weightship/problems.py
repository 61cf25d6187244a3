"""Reading an HTTP error answer into our exception tree: the one error mapping of every client.

A non-2xx answer is read, in this order, as

- RFC 9457 problem details (``application/problem+json``: ``type``, ``title``, ``status``,
  ``detail``, and our extension ``code``): ``detail`` (else ``title``) is the message;
- our older error body ``{"error": {"code": ..., "message": ...}}``, which servers of the
  previous version still send;
- S3's XML error document (``<Code>``, ``<Message>``), for presigned part uploads;
- anything else (a proxy's HTML page, a framework's text): the status and a snippet.

The class comes from the ``code`` when the body names one we know (the most specific answer),
else from the HTTP status. A ``TemporaryError`` carries the server's ``Retry-After`` (seconds or
an HTTP date) as its ``delay``, so the retry engine (``weightship.backoff``) waits at least that
long. The body is parsed tolerantly here, not with a response schema: a server mid-upgrade may
send either shape, and an error answer must never turn into a second, confusing error.

The writing side lives here too, so that every server of ours (the control plane's FastAPI app,
the agent's local API and peer listener) builds the same document from the same error:
``problem_document`` is the body, ``error_problem`` maps a ``WeightshipError`` to body and headers
(``Retry-After`` for a ``TemporaryError``, ``WWW-Authenticate`` for a 401).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from http import HTTPStatus
from typing import Any

import httpx

from weightship.errors import (
    AuthError,
    ConflictError,
    DatabaseUnavailable,
    DiskFullError,
    Field,
    ForbiddenError,
    IntegrityError,
    ManifestError,
    NotFoundError,
    PayloadTooLarge,
    PreconditionFailed,
    PreconditionRequired,
    StoreError,
    TemporaryError,
    ValidationError,
    WeightshipError,
)

__all__ = [
    "LEGACY_CODES",
    "MAX_RETRY_AFTER",
    "PROBLEM_MEDIA_TYPE",
    "error_from_response",
    "error_problem",
    "problem_document",
    "retry_after",
    "status_title",
]

#: The longest ``Retry-After`` honoured, in seconds: a longer hint is a misconfigured server.
MAX_RETRY_AFTER = 60.0
#: The media type of RFC 9457 problem details.
PROBLEM_MEDIA_TYPE = "application/problem+json"
_TYPE_BASE = "https://weightship.dev/problems/"

#: Error classes by the ``code`` a body names; the most specific answer wins.
_BY_CODE: dict[str, type[WeightshipError]] = {
    cls.code: cls
    for cls in (
        ValidationError,
        ManifestError,
        PayloadTooLarge,
        IntegrityError,
        NotFoundError,
        ConflictError,
        PreconditionFailed,
        PreconditionRequired,
        AuthError,
        ForbiddenError,
        StoreError,
        TemporaryError,
        DatabaseUnavailable,
        DiskFullError,
    )
}
#: Error classes by HTTP status, for bodies without a known code (proxies, S3, other servers).
_BY_STATUS: dict[int, type[WeightshipError]] = {
    400: ValidationError,
    401: AuthError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    412: PreconditionFailed,
    413: PayloadTooLarge,
    422: ValidationError,
    428: PreconditionRequired,
    429: TemporaryError,
    502: StoreError,
    503: TemporaryError,
    504: TemporaryError,
    507: DiskFullError,
}
#: Codes that servers of the previous release spelled in kebab-case; read as today's snake_case.
LEGACY_CODES = {
    "rollout-active": "rollout_active",
    "rollout-verb": "rollout_verb",
    "rollout-spec": "rollout_spec",
    "rollout-busy": "rollout_busy",
    "rollout-status": "rollout_status",
}

#: S3 error codes that mean the bytes did not match the checksum we sent.
_S3_INTEGRITY_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"})
_XML_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")


def status_title(status: int) -> str:
    """The standard reason phrase of ``status`` (the problem's ``title``)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def problem_document(
    status: int, code: str, detail: str, instance: str, fields: Mapping[str, Field | int] | None = None
) -> dict[str, Any]:
    """RFC 9457 problem details with our stable ``code``; ``fields`` become further members."""
    body: dict[str, Any] = {
        "type": _TYPE_BASE + code,
        "title": status_title(status),
        "status": status,
        "detail": detail,
        "instance": instance,
        "code": code,
    }
    for name, value in (fields or {}).items():
        body.setdefault(name, value)  # the standard members win over a field of the same name
    return body


def error_problem(
    err: WeightshipError, instance: str, *, challenge: str = "Bearer"
) -> tuple[dict[str, Any], dict[str, str]]:
    """The problem document and headers that ``err``, escaping a request to ``instance``, answers with.

    ``challenge`` is the ``WWW-Authenticate`` scheme of a 401 (``Bearer`` tokens on the control
    plane, ``Ticket`` on the agent's peer listener).
    """
    headers: dict[str, str] = {}
    fields: dict[str, Field | int] = dict(err.fields)
    if err.status_code == 401:
        headers["WWW-Authenticate"] = challenge
    if isinstance(err, TemporaryError):
        seconds = max(1, math.ceil(err.delay))
        headers["Retry-After"] = str(seconds)
        fields["retry_after"] = seconds
    return problem_document(err.status_code, err.code, err.message, instance, fields), headers


def error_from_response(response: httpx.Response, what: str) -> WeightshipError:
    """The ``WeightshipError`` that a non-2xx ``response`` to ``what`` (e.g. ``GET /v1/x``) means."""
    status = response.status_code
    code, message, fields = _read_body(response)
    if code is not None:
        code = LEGACY_CODES.get(code, code)
    cls = _BY_CODE.get(code) if code is not None else None
    if message is None:
        message = _describe_unreadable(response, what)
        if _s3_code(response) in _S3_INTEGRITY_CODES:
            cls = IntegrityError
    if cls is None:
        cls = _BY_STATUS.get(status)
    if cls is None:
        cls = TemporaryError if status >= 500 else WeightshipError
    error = cls(message, delay=retry_after(response)) if issubclass(cls, TemporaryError) else cls(message)
    if code is not None:
        # the server's own code is more specific than the class's (the CLI words its answer by it)
        error.code = code
    error.fields = fields
    return error


def retry_after(response: httpx.Response, *, now: float | None = None) -> float:
    """The server's ``Retry-After`` in seconds, at most ``MAX_RETRY_AFTER``; 0 when it gave none.

    Both forms RFC 9110 allows are read: a number of seconds and an HTTP date.
    """
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 0.0  # unreadable: back off by the exponential step alone
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return 0.0
    return max(0.0, min(seconds, MAX_RETRY_AFTER))


#: problem members that are not extension fields of ours
_PROBLEM_MEMBERS = frozenset({"type", "title", "status", "detail", "instance", "code"})


def _read_body(response: httpx.Response) -> tuple[str | None, str | None, dict[str, Field]]:
    """``(code, message, fields)`` from a problem-details or legacy error body; ``None``/empty where absent."""
    try:
        doc: Any = json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        return None, None, {}
    if not isinstance(doc, dict):
        return None, None, {}
    legacy = doc.get("error")
    if isinstance(legacy, dict) and isinstance(legacy.get("message"), str):
        code = legacy.get("code")
        return (code if isinstance(code, str) else None), legacy["message"], {}
    if _is_problem(response, doc):
        code = doc.get("code")
        detail = doc.get("detail")
        title = doc.get("title")
        message = detail if isinstance(detail, str) and detail else title if isinstance(title, str) else None
        fields = {
            k: v
            for k, v in doc.items()
            if k not in _PROBLEM_MEMBERS and (v is None or isinstance(v, str | int | float))
        }
        return (code if isinstance(code, str) else None), message, fields
    return None, None, {}


def _is_problem(response: httpx.Response, doc: dict[str, Any]) -> bool:
    """Whether ``doc`` is problem details: by media type, or by its members when a proxy relabelled it."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == PROBLEM_MEDIA_TYPE:
        return True
    return isinstance(doc.get("code"), str) and isinstance(doc.get("detail"), str) and "status" in doc


def _s3_code(response: httpx.Response) -> str | None:
    text = response.text.strip()
    return dict(_XML_FIELD.findall(text)).get("Code") if text.startswith("<") else None


def _describe_unreadable(response: httpx.Response, what: str) -> str:
    """A message for a body that is neither of our shapes, saying what to check."""
    status = response.status_code
    text = response.text.strip()
    fields = dict(_XML_FIELD.findall(text)) if text.startswith("<") else {}
    if fields:
        return f"{what} answered {status} {fields.get('Code', '')}: {fields.get('Message', '')}".strip()
    message = f"{what} answered HTTP {status}: {text[:200] or response.reason_phrase}"
    if status >= 500:
        message += "; the server failed without saying why: check its log, then retry"
    elif status in (404, 405):
        message += "; no such route: check that the URL names a weightship server of this version"
    return message
