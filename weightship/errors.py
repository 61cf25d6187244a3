"""One rooted exception tree for every weightship error.

Lower-layer errors (boto, SQLAlchemy, aiohttp, httpx) are mapped into these at the boundary
where they occur, so callers catch ours, never a library's. Errors split by behaviour, as in
kopf: ``TemporaryError(delay)`` means "retry later" (after ``delay`` seconds, the server's
``Retry-After`` when it gave one), ``PermanentError`` means "give up and report": retrying the
same call cannot succeed. Every class below is one or the other; a bare ``WeightshipError``
(an answer this version cannot read, say) counts as permanent too. The retry engine
(``weightship.backoff``) retries exactly the temporary ones.
"""

from __future__ import annotations

from collections.abc import Mapping

#: the value of one of an error's ``fields``
Field = str | int | float | None

__all__ = [
    "AuthError",
    "ConflictError",
    "DatabaseUnavailable",
    "DiskFullError",
    "ForbiddenError",
    "IntegrityError",
    "ManifestError",
    "NotFoundError",
    "PayloadTooLarge",
    "PermanentError",
    "PreconditionFailed",
    "PreconditionRequired",
    "StoreError",
    "TemporaryError",
    "ValidationError",
    "WeightshipError",
]


class WeightshipError(Exception):
    """Root of every error weightship raises on purpose."""

    #: HTTP status the control plane answers with when this error escapes a route.
    status_code: int = 500
    #: Short machine-readable code carried in API error bodies.
    code: str = "internal"

    def __init__(self, message: str, *, code: str | None = None, fields: Mapping[str, Field] | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code  # more specific than the class's, and as stable (e.g. ``model_not_found``)
        #: what the error is about, by name (``model``, ``deployment``, ``epoch``...), so that each
        #: interface can say it in its own words (the CLI names commands and flags, not routes)
        self.fields: dict[str, Field] = dict(fields or {})
        self.message = message


class PermanentError(WeightshipError):
    """A failure that retrying the same call will not fix: report it, or change the input."""


class ValidationError(PermanentError):
    """Input that is malformed or breaks a rule; fix the input and try again."""

    status_code = 400
    code = "invalid"


class ManifestError(ValidationError):
    """A manifest (or the model directory it is built from) breaks the manifest contract."""

    code = "invalid_manifest"


class PayloadTooLarge(ValidationError):
    """A request body larger than the route accepts; nothing of it was kept."""

    status_code = 413
    code = "too_large"


class IntegrityError(PermanentError):
    """Bytes do not match the digest or size that the manifest promises."""

    status_code = 422
    code = "integrity"


class NotFoundError(PermanentError):
    """The named model, version, label, deployment, node or blob does not exist."""

    status_code = 404
    code = "not_found"


class ConflictError(PermanentError):
    """The request conflicts with the current state (label already used, no previous version)."""

    status_code = 409
    code = "conflict"


class PreconditionFailed(ConflictError):
    """A compare-and-swap lost: the expected epoch or ETag is no longer current."""

    status_code = 412
    code = "precondition_failed"


class PreconditionRequired(ValidationError):
    """A compare-and-swap write sent without ``If-Match``: read the current ETag and send it."""

    status_code = 428
    code = "precondition_required"


class AuthError(PermanentError):
    """No credentials, or credentials that are not valid."""

    status_code = 401
    code = "unauthenticated"


class ForbiddenError(PermanentError):
    """Valid credentials whose role does not allow this call."""

    status_code = 403
    code = "forbidden"


class StoreError(PermanentError):
    """The origin store failed in a way that retrying will not fix."""

    status_code = 502
    code = "store"


class TemporaryError(WeightshipError):
    """A failure that may pass: retry after ``delay`` seconds."""

    status_code = 503
    code = "unavailable"

    def __init__(self, message: str, delay: float = 1.0) -> None:
        super().__init__(message)
        self.delay = delay


class DatabaseUnavailable(TemporaryError):
    """The control plane's database is locked, overloaded, unreachable, or not the file it opened."""

    code = "database_unavailable"


class DiskFullError(PermanentError):
    """Local disk (or quota) has no room for the bytes that must be written."""

    status_code = 507
    code = "disk_full"
