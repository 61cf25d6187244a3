"""The host-local CRC32 record that ``verify="fast"`` checks against.

The manifest only carries SHA-256 digests, which cost about a core-second per 1.2 GB to check.
A fast load checks each chunk's CRC32 (about 3x cheaper, and ``zlib`` releases the GIL) against
a record written by an earlier load on this host that verified the same chunk with SHA-256 and
computed its CRC32 in the same pass. A record entry is trusted only while the file's identity
``(st_dev, st_ino, st_size, st_mtime_ns)`` is unchanged, so a replaced or rewritten file falls
back to SHA-256. Chunks without a usable entry are verified with SHA-256 and added.

What this guarantees: every byte handed out was, on this host and this inode, part of a chunk
whose SHA-256 matched the manifest, and has not changed since by any accident (bit rot, a torn
or partial write, truncation, a file swapped in place) that CRC32 detects. It is not a defence
against someone who can rewrite both the weights and this record; use ``verify="full"`` there.

Records live in ``$WEIGHTSHIP_CHECKSUM_DIR``, else ``$XDG_CACHE_HOME/weightship/checksums``,
else ``~/.cache/weightship/checksums``: one JSON file per version, replaced atomically. A store
that cannot be written costs speed (the next fast load hashes again), never correctness.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from weightship.digests import hex_of
from weightship.logs import event

__all__ = ["ChecksumRecord", "ChecksumStore", "Identity", "default_checksum_dir"]

_log = logging.getLogger(__name__)
_SCHEMA = "weightship.gpu_loader.crc32/v1"

#: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of an open file.
Identity = tuple[int, int, int, int]


def default_checksum_dir() -> Path:
    """Where fast-mode records live unless a directory is given."""
    explicit = os.environ.get("WEIGHTSHIP_CHECKSUM_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "weightship" / "checksums"


@dataclass
class ChecksumRecord:
    """CRC32 of verified chunks of one version, per file, tied to each file's identity."""

    digest: str
    files: dict[str, tuple[Identity, dict[int, int]]] = field(default_factory=dict)
    changed: bool = False

    def expected(self, path: str, identity: Identity, chunk: int) -> int | None:
        """The recorded CRC32 of ``chunk`` of ``path``, if the record is for this very file."""
        entry = self.files.get(path)
        if entry is None or entry[0] != identity:
            return None
        return entry[1].get(chunk)

    def add(self, path: str, identity: Identity, chunk: int, crc: int) -> None:
        """Record the CRC32 of a chunk that just passed SHA-256."""
        entry = self.files.get(path)
        if entry is None or entry[0] != identity:
            entry = (identity, {})
            self.files[path] = entry
        entry[1][chunk] = crc
        self.changed = True

    def to_json(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "schema": _SCHEMA,
            "digest": self.digest,
            "files": {
                path: {"identity": list(ident), "crc32": {str(k): v for k, v in sorted(crcs.items())}}
                for path, (ident, crcs) in sorted(self.files.items())
            },
        }


class ChecksumStore:
    """Reads and writes ``ChecksumRecord`` files in one directory."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_checksum_dir()

    def _path(self, digest: str) -> Path:
        return self.directory / f"{hex_of(digest)}.json"

    def read(self, digest: str) -> ChecksumRecord:
        """The record of ``digest``; empty when there is none or it cannot be read."""
        record = ChecksumRecord(digest=digest)
        try:
            doc = json.loads(self._path(digest).read_text(encoding="utf-8"))
            if doc.get("schema") != _SCHEMA or doc.get("digest") != digest:
                return record
            for path, entry in doc["files"].items():
                ident = tuple(int(x) for x in entry["identity"])
                if len(ident) != 4:
                    continue
                crcs = {int(k): int(v) for k, v in entry["crc32"].items()}
                record.files[str(path)] = ((ident[0], ident[1], ident[2], ident[3]), crcs)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            event(_log, "checksums.unreadable", logging.WARNING, digest=digest, error=exc)
        return record

    def write(self, record: ChecksumRecord) -> bool:
        """Replace the stored record atomically; ``False`` (and a warning) if it cannot be written."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".crc-", dir=self.directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump(record.to_json(), handle, separators=(",", ":"))
                os.replace(tmp, self._path(record.digest))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            event(_log, "checksums.unwritable", logging.WARNING, directory=self.directory, error=exc)
            return False
        record.changed = False
        return True
