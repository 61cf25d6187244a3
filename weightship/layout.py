"""The on-disk layout of a version on a node, shared by the agent (writer) and model servers.

::

    <data_dir>/versions/<hex>/                 the files of the version, read-only once ready
    <data_dir>/versions/<hex>/.weightship/manifest.json   the manifest bytes exactly as published
    <data_dir>/versions/<hex>/.weightship/verified.json   the agent's verification record

Manifest paths can never start with '.', so ``.weightship/`` cannot collide with model files.
A version directory exists under its final name only once every chunk has been verified: the
agent assembles it elsewhere and renames it into place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from weightship.digests import hex_of
from weightship.errors import NotFoundError
from weightship.manifest import Manifest, check_manifest_bytes, parse_manifest

__all__ = [
    "MANIFEST_FILE",
    "META_DIR",
    "VERIFIED_FILE",
    "VerificationRecord",
    "read_verification",
    "read_version_manifest",
    "version_dir",
    "write_verification",
]

META_DIR = ".weightship"
MANIFEST_FILE = "manifest.json"
VERIFIED_FILE = "verified.json"


def version_dir(data_dir: Path, digest: str) -> Path:
    """Where a ready version lives under an agent's data directory."""
    return Path(data_dir) / "versions" / hex_of(digest)


def read_version_manifest(directory: Path, digest: str | None = None) -> Manifest:
    """The manifest stored beside a version's files, checked against its digest.

    ``digest`` defaults to the directory's name; a mismatch is an ``IntegrityError``.
    """
    path = Path(directory) / META_DIR / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotFoundError(f"{path} is missing: {directory} is not a weightship version directory") from None
    check_manifest_bytes(raw, digest or Path(directory).name, str(path), "the version directory is corrupt")
    return parse_manifest(raw)


@dataclass(frozen=True, slots=True)
class VerificationRecord:
    """The agent's statement that every chunk of a version matched the manifest."""

    digest: str
    verified_at: datetime
    chunks_verified: int
    bytes_verified: int

    def to_json(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "digest": self.digest,
            "verified_at": self.verified_at.isoformat(),
            "chunks_verified": self.chunks_verified,
            "bytes_verified": self.bytes_verified,
        }


def write_verification(directory: Path, manifest: Manifest) -> VerificationRecord:
    """Record that every chunk of ``manifest`` under ``directory`` was verified."""
    record = VerificationRecord(
        digest=manifest.digest,
        verified_at=datetime.now(UTC),
        chunks_verified=sum(len(f.chunks) for f in manifest.files),
        bytes_verified=manifest.total_size,
    )
    meta = Path(directory) / META_DIR
    meta.mkdir(exist_ok=True)
    (meta / VERIFIED_FILE).write_text(json.dumps(record.to_json()), encoding="utf-8")
    return record


def read_verification(directory: Path) -> VerificationRecord | None:
    """The verification record of a version directory, or ``None`` if there is none."""
    path = Path(directory) / META_DIR / VERIFIED_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return VerificationRecord(
            digest=str(doc["digest"]),
            verified_at=datetime.fromisoformat(doc["verified_at"]),
            chunks_verified=int(doc["chunks_verified"]),
            bytes_verified=int(doc["bytes_verified"]),
        )
    except (FileNotFoundError, KeyError, ValueError):
        return None
