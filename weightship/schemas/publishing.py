"""Publishing and the registry: uploads, their blobs and parts, versions, labels, models."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from weightship.schemas.base import INT64_MAX, Count, Digest, HexDigest, Label, Name, Schema

__all__ = [
    "BlobUpload",
    "LabelCreate",
    "ModelInfo",
    "PartUpload",
    "UploadCreate",
    "UploadSession",
    "VersionInfo",
]

class UploadCreate(Schema):
    """Open (or resume) a publish session for a manifest."""

    manifest: str = Field(description="the canonical manifest JSON, exactly the bytes to be stored")
    labels: list[Label] = Field(default_factory=list)
    allow_pickle: bool = False


class PartUpload(Schema):
    """One part (= one chunk) of a blob to upload: PUT the chunk's bytes to ``url``."""

    number: int = Field(ge=1, le=INT64_MAX, description="1-based part number; chunk index + 1")
    offset: Count
    length: Count
    sha256: HexDigest
    url: str = Field(description="absolute URL, or a path relative to the API base")
    headers: dict[str, str] = Field(default_factory=dict, description="headers the PUT must carry")
    done: bool = False


class BlobUpload(Schema):
    """A file's blob: already in the store, or the parts still to upload."""

    sha256: HexDigest
    size: Count
    present: bool
    method: str = Field(description="'s3-multipart' or 'http-put'")
    parts: list[PartUpload] = Field(default_factory=list)


class UploadSession(Schema):
    """A publish session: upload the missing parts, then commit."""

    id: str
    model: Name
    digest: Digest
    state: str = Field(description="'open', 'committed' or 'aborted'")
    expires_at: datetime
    labels: list[Label]
    blobs: list[BlobUpload]
    bytes_total: Count
    bytes_missing: Count


class VersionInfo(Schema):
    """A published, immutable version."""

    model: Name
    digest: Digest
    labels: list[Label]
    state: str
    size: Count
    files: Count
    created_at: datetime
    created_by: str


class LabelCreate(Schema):
    """Attach a label to a ready version; labels never move once set."""

    label: Label
    digest: Digest


class ModelInfo(Schema):
    """A model and its version count."""

    name: Name
    versions: Count
    allow_pickle: bool = False
    created_at: datetime
