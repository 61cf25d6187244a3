"""The one place digests are computed and parsed.

A digest is written ``sha256:<64 lowercase hex>``. Blob keys use the bare hex.
"""

from __future__ import annotations

import hashlib
import re

from weightship.errors import ValidationError

__all__ = ["ALGORITHM", "format_digest", "hex_of", "is_hex", "parse_digest", "sha256_hex", "sha256_stream"]

ALGORITHM = "sha256"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """SHA-256 of ``data`` as 64 lowercase hex characters."""
    return hashlib.sha256(data).hexdigest()


def sha256_stream() -> hashlib._Hash:
    """An incremental SHA-256 for bytes that arrive in pieces; ``hexdigest()`` matches ``sha256_hex``."""
    return hashlib.sha256()


def format_digest(hex_value: str) -> str:
    """``sha256:<hex>`` from bare hex."""
    if not _HEX.match(hex_value):
        raise ValidationError(f"not a sha256 hex value: {hex_value!r}")
    return f"{ALGORITHM}:{hex_value}"


def parse_digest(digest: str) -> str:
    """The bare hex of a ``sha256:<hex>`` digest; a clear error for anything else."""
    match = _DIGEST.match(digest)
    if not match:
        raise ValidationError(f"not a version digest: {digest!r}; expected 'sha256:' followed by 64 lowercase hex")
    return match.group(1)


def is_hex(value: str) -> bool:
    """Whether ``value`` is 64 lowercase hex characters."""
    return bool(_HEX.match(value))


def hex_of(value: str) -> str:
    """Bare hex from either ``sha256:<hex>`` or ``<hex>``."""
    return value if is_hex(value) else parse_digest(value)
