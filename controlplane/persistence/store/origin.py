"""The origin store's one interface, its object layout, and the shapes both backends return.

Layout (the same under an S3 prefix or a local directory)::

    blobs/sha256/<file-sha256>         a file's bytes; a chunk is a byte range of a blob
    manifests/sha256/<version-hex>     the canonical manifest bytes; the version id is their sha256
    provenance/sha256/<version-hex>    who first published the version and when (JSON)
    labels/<model>/<label>             the digest a label names (JSON), so labels survive the database
    uploads/sha256/<file-sha256>/<id>  S3 only: a multipart upload, completed here and hashed before
                                       it is copied to ``blobs/``; deleted once placed or refused

Every object is written once and never overwritten: ``If-None-Match: *`` on S3, an exclusive
create on disk. Objects are content-addressed (blobs, manifests) or claim a name for good
(labels), so "already there" is an answer, not an error: ``put_once`` says which happened.

Blobs arrive through an *upload*: ``begin_upload`` opens one (an S3 multipart upload, or a
staging directory), the client sends its parts (part ``n`` = chunk ``n - 1``) to where
``part_target`` says (a presigned S3 URL) or the control plane streams them into ``open_part``
(local store), and ``complete_upload`` verifies every part against the manifest's chunk digests
and publishes the blob under its final key, or raises and publishes nothing. Whatever sits under
``blobs/sha256/<sha>`` hashes to ``<sha>``: no client ever writes there, only ``complete_upload``
after it checked the whole-file SHA-256 (see "Trust invariant" in ``docs/architecture.md``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from weightship.digests import hex_of
from weightship.errors import ValidationError
from weightship.manifest import Manifest

__all__ = [
    "BLOBS",
    "LABELS",
    "MANIFESTS",
    "PROVENANCE",
    "SIGNATURES",
    "UPLOADS",
    "BlobStat",
    "OriginStore",
    "PartSpec",
    "PartTarget",
    "PartWriter",
    "UploadedPart",
    "blob_key",
    "check_key",
    "label_key",
    "manifest_key",
    "provenance_key",
]

BLOBS = "blobs/sha256/"
MANIFESTS = "manifests/sha256/"
PROVENANCE = "provenance/sha256/"
LABELS = "labels/"
UPLOADS = "uploads/sha256/"
#: ``signatures/sha256/<version hex>/<sha256 of the bundle>``: a version's signatures, write-once, append-only
SIGNATURES = "signatures/sha256/"

_KEY = re.compile(
    r"^(?:(?:blobs|manifests|provenance)/sha256/[0-9a-f]{64}"
    r"|uploads/sha256/[0-9a-f]{64}/[0-9a-f]{32}"
    r"|signatures/sha256/[0-9a-f]{64}/[0-9a-f]{64}"
    r"|labels/[a-z0-9][a-z0-9._-]{0,127}/[A-Za-z0-9][A-Za-z0-9._-]{0,127})$"
)


def blob_key(sha256: str) -> str:
    """Key of the blob whose bytes hash to ``sha256`` (hex)."""
    return BLOBS + hex_of(sha256)


def manifest_key(digest: str) -> str:
    """Key of the manifest of version ``digest`` (``sha256:<hex>`` or hex)."""
    return MANIFESTS + hex_of(digest)


def provenance_key(digest: str) -> str:
    """Key of the provenance record of version ``digest``."""
    return PROVENANCE + hex_of(digest)


def label_key(model: str, label: str) -> str:
    """Key of the record that ``label`` of ``model`` names a digest."""
    return check_key(f"{LABELS}{model}/{label}")


def check_key(key: str) -> str:
    """``key`` if it is one of the layout's keys; anything else (``..``, odd names) is refused."""
    if not _KEY.match(key):
        raise ValidationError(
            f"{key!r} is not an origin-store key (blobs/, manifests/, provenance/, signatures/ or labels/)"
        )
    return key


@dataclass(frozen=True, slots=True)
class PartSpec:
    """One part of a blob upload: chunk ``number - 1`` of the file, and the digest it must have."""

    number: int
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True, slots=True)
class UploadedPart:
    """A part the store holds for an open upload; ``sha256`` (hex) when the store knows it."""

    number: int
    size: int
    sha256: str | None
    etag: str = ""


@dataclass(frozen=True, slots=True)
class PartTarget:
    """Where a client PUTs a part itself, and the headers the PUT must carry."""

    url: str
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class BlobStat:
    """What the store says about a stored blob without reading it.

    ``checksum`` is a SHA-256 checksum in S3's form (base64, any ``-N`` part-count suffix
    removed): of the whole object for a single PUT, or the composite (the SHA-256 of the part
    digests) for a multipart upload; ``part_size`` is the part (= chunk) size it was uploaded
    with. Either is ``None`` where the store does not know it.
    """

    size: int
    checksum: str | None
    etag: str = ""
    part_size: int | None = None


class PartWriter(Protocol):
    """Receives one part's bytes as they stream in; ``finish`` checks them before keeping them."""

    def write(self, data: bytes) -> None:
        """Append ``data``; more bytes than the part's length is an ``IntegrityError``."""

    def finish(self) -> None:
        """Check length and SHA-256 and keep the part, or discard it with an ``IntegrityError``."""

    def discard(self) -> None:
        """Drop whatever was written; the part stays not done."""


class OriginStore(Protocol):
    """The origin of every byte: S3 or a local directory, same behaviour (see module docstring).

    Errors: ``NotFoundError`` for a missing object or upload, ``IntegrityError`` for bytes that
    do not match, ``ConflictError`` for an upload that is not complete yet, ``TemporaryError``
    when the store is unreachable or overloaded after retries, ``StoreError`` when retrying
    cannot help (credentials, missing bucket).
    """

    #: ``"s3"`` or ``"local"``
    kind: str

    def describe(self) -> str:
        """Where the store is, for logs and messages (no secrets)."""
        ...

    def check_manifest(self, manifest: Manifest) -> None:
        """Refuse (``ValidationError``) a manifest whose chunking this store cannot take as parts."""
        ...

    def put_once(self, key: str, data: bytes) -> bool:
        """Write a small object unless ``key`` exists; ``True`` if this call wrote it."""
        ...

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        """The bytes of a small object; ``NotFoundError`` if absent, ``StoreError`` if over ``max_bytes``."""
        ...

    def list_keys(self, prefix: str) -> Iterator[str]:
        """Every key under ``prefix`` (one of the layout's folders), in no promised order."""
        ...

    def stat_blob(self, sha256: str) -> BlobStat | None:
        """Size and checksum of a stored blob, or ``None`` if the store lacks it."""
        ...

    def read_blob(self, sha256: str) -> Iterator[bytes]:
        """The blob's bytes in order, in pieces of bounded size (for a streaming re-hash)."""
        ...

    def begin_upload(self, sha256: str, part_size: int) -> str:
        """Open an upload of blob ``sha256`` in parts of ``part_size`` (the last shorter); returns its id."""
        ...

    def uploaded_parts(self, sha256: str, upload_id: str) -> dict[int, UploadedPart]:
        """The parts the store holds for an open upload; ``NotFoundError`` if it is gone."""
        ...

    def part_target(self, sha256: str, upload_id: str, part: PartSpec, expires_in: int) -> PartTarget | None:
        """A URL the client PUTs the part to directly, or ``None`` if it goes through ``open_part``."""
        ...

    def open_part(self, sha256: str, upload_id: str, part: PartSpec) -> PartWriter:
        """Receive a part through the control plane (local store); S3 refuses with ``ValidationError``."""
        ...

    def complete_upload(self, sha256: str, upload_id: str, parts: Sequence[PartSpec]) -> bool:
        """Verify every part and publish the blob write-once; ``True`` if this call published it.

        ``False`` means the blob was already there (another upload won); the caller checks that
        the stored blob matches. Nothing is published when a part is missing (``ConflictError``)
        or does not match (``IntegrityError``).
        """
        ...

    def abort_upload(self, sha256: str, upload_id: str) -> None:
        """Discard an upload and its parts; a no-op if it is already gone."""
        ...

    def read_url(self, sha256: str, expires_in: int) -> str | None:
        """A presigned GET of the blob, or ``None`` when the control plane serves blobs itself."""
        ...
