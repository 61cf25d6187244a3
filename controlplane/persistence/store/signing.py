"""Signed read URLs for blobs the control plane serves itself (the local-directory store).

An agent asks ``POST /v1/blobs/urls`` with its token and gets, per blob,
``<public_url>/v1/blobs/<sha256>?expires=<unix seconds>&sig=<hex>``. The signature is an
HMAC-SHA256 under ``settings.url_signing_key`` over the method, path and expiry, so the URL
alone authorises reading that one blob until it expires, like a presigned S3 GET, and can be
handed to a peer or a cache without handing over a token.
"""

from __future__ import annotations

import hashlib
import hmac

from weightship.errors import ForbiddenError

__all__ = ["blob_path", "sign_blob", "signed_blob_url", "verify_blob_signature"]


def blob_path(sha256: str) -> str:
    """The control-plane path that serves blob ``sha256``."""
    return f"/v1/blobs/{sha256}"


def sign_blob(key: str, sha256: str, expires: int) -> str:
    """The signature of a GET of blob ``sha256`` valid until ``expires`` (unix seconds)."""
    message = f"GET\n{blob_path(sha256)}\n{expires}".encode("ascii")
    return hmac.new(key.encode("utf-8"), message, hashlib.sha256).hexdigest()


def signed_blob_url(base_url: str, key: str, sha256: str, expires: int) -> str:
    """An absolute URL that reads blob ``sha256`` until ``expires`` without a token."""
    return f"{base_url.rstrip('/')}{blob_path(sha256)}?expires={expires}&sig={sign_blob(key, sha256, expires)}"


def verify_blob_signature(key: str, sha256: str, expires: int, sig: str, now: float) -> None:
    """Raise ``ForbiddenError`` unless ``sig`` signs this blob and ``expires`` is still ahead."""
    if not hmac.compare_digest(sign_blob(key, sha256, expires), sig):
        raise ForbiddenError(
            f"the signature of this URL for blob {sha256} is not valid; ask POST /v1/blobs/urls for a new one"
        )
    if now >= expires:
        raise ForbiddenError(f"this URL for blob {sha256} expired at {expires}; ask POST /v1/blobs/urls for a new one")
