"""Origin stores: one interface (``OriginStore``), two backends (S3, a local directory).

``open_store(settings)`` picks the backend from ``settings.store_url``:

- ``local:/path`` — a directory on this machine (the embedded default);
- ``s3://bucket[/prefix][?option=value&...]`` — S3 at ``settings.s3_endpoint_url`` (AWS when
  empty). Options: ``attempts``, ``sdk_attempts``, ``backoff`` (seconds), ``max_backoff``,
  ``connect_timeout``, ``read_timeout`` (seconds) and ``min_part_size`` (bytes; 5 MiB on AWS, a
  test S3 may allow less).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from controlplane.persistence.store.localdir import LocalStore
from controlplane.persistence.store.origin import (
    BlobStat,
    OriginStore,
    PartSpec,
    PartTarget,
    PartWriter,
    UploadedPart,
    blob_key,
    label_key,
    manifest_key,
    provenance_key,
)
from controlplane.persistence.store.retrying import RetryPolicy
from controlplane.persistence.store.s3 import MIN_PART_SIZE, S3Store
from controlplane.settings import Settings
from weightship.errors import ValidationError

__all__ = [
    "BlobStat",
    "LocalStore",
    "OriginStore",
    "PartSpec",
    "PartTarget",
    "PartWriter",
    "RetryPolicy",
    "S3Store",
    "UploadedPart",
    "blob_key",
    "label_key",
    "manifest_key",
    "open_store",
    "provenance_key",
    "store_from_url",
]

_FLOAT_OPTIONS = {
    "backoff": "base_delay",
    "max_backoff": "max_delay",
    "connect_timeout": "connect_timeout",
    "read_timeout": "read_timeout",
}
_INT_OPTIONS = {"attempts": "attempts", "sdk_attempts": "sdk_attempts"}


def store_from_url(url: str, *, s3_endpoint_url: str = "", s3_region: str = "us-east-1") -> OriginStore:
    """The store that ``url`` names (see the module docstring)."""
    if url.startswith("local:"):
        path = url.removeprefix("local:")
        if not path:
            raise ValidationError("store URL 'local:' needs a directory, e.g. local:/var/lib/weightship/origin")
        return LocalStore(Path(path))
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValidationError(f"store URL {url!r} must be local:/path or s3://bucket[/prefix]")
    policy_args: dict[str, Any] = {}
    min_part_size = MIN_PART_SIZE
    for name, value in parse_qsl(parts.query, strict_parsing=False):
        try:
            if name in _FLOAT_OPTIONS:
                policy_args[_FLOAT_OPTIONS[name]] = float(value)
            elif name in _INT_OPTIONS:
                policy_args[_INT_OPTIONS[name]] = int(value)
            elif name == "min_part_size":
                min_part_size = int(value)
            else:
                raise ValidationError(f"store URL option {name!r} is unknown")
        except ValueError:
            raise ValidationError(f"store URL option {name}={value!r} is not a number") from None
    return S3Store(
        parts.netloc,
        parts.path,
        endpoint_url=s3_endpoint_url or None,
        region=s3_region,
        policy=RetryPolicy(**policy_args),
        min_part_size=min_part_size,
    )


def open_store(settings: Settings) -> OriginStore:
    """The origin store the control plane's settings name."""
    return store_from_url(settings.store_url, s3_endpoint_url=settings.s3_endpoint_url, s3_region=settings.s3_region)
