"""The local-directory origin store: the embedded default, same layout and promises as S3.

Write-once on disk: an object is written to a temporary file, fsynced, and then *linked* into
its final name. ``link(2)`` fails when the name exists, which makes it the atomic
create-if-absent that ``O_EXCL`` gives a single open, without ever exposing a half-written file
(``rename(2)`` would silently replace an existing object instead).

An upload lives in ``staging/<upload-id>/``::

    blob            the blob being assembled; each part is written at its own offset
    target          "<sha256> <part size>": what the blob must end up as, and its part size
    parts/<n>       "<length> <sha256>": part n was received, hashed and fsynced

Beside each published blob, ``checksums/<sha256>`` holds "<part size> <composite checksum>",
the same checksum S3 keeps for a multipart object, so that a later manifest naming this blob is
checked against the chunks it was verified with (``BlobStat``), on disk as on S3.

A part arriving through the control plane is hashed while it streams to disk; only when its
length and SHA-256 match is its ``parts/<n>`` marker written. Completing re-reads the staged
blob once, checking every chunk and the whole-file digest, then links it into ``blobs/sha256/``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from controlplane.persistence.store.origin import (
    BlobStat,
    PartSpec,
    PartTarget,
    UploadedPart,
    blob_key,
    check_key,
)
from controlplane.persistence.store.parts import StreamVerifier, check_uploaded, composite_checksum
from weightship.digests import sha256_stream
from weightship.errors import DiskFullError, IntegrityError, NotFoundError, StoreError, ValidationError
from weightship.logs import event
from weightship.manifest import Manifest

__all__ = ["LocalStore"]

log = logging.getLogger(__name__)

_READ_SIZE = 1024 * 1024
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_error(exc: OSError, what: str) -> Exception:
    if exc.errno in (28, 122):  # ENOSPC, EDQUOT
        return DiskFullError(f"no space left writing {what}: free disk space under the store directory")
    return StoreError(f"local store failed writing {what}: {exc}")


class _LocalPartWriter:
    """Streams one part into the staged blob at its offset, hashing as it goes."""

    def __init__(self, blob_file: Path, marker: Path, part: PartSpec, blob: str) -> None:
        self._marker = marker
        self._part = part
        self._blob = blob
        self._hash = sha256_stream()
        self._written = 0
        # A part sent again overwrites its byte range, so it is not done until it checks out anew.
        marker.unlink(missing_ok=True)
        self._fd = os.open(blob_file, os.O_WRONLY)

    def write(self, data: bytes) -> None:
        """Write ``data`` at the part's next offset."""
        if self._written + len(data) > self._part.length:
            self.discard()
            raise IntegrityError(
                f"part {self._part.number} of blob {self._blob} is longer than its {self._part.length} bytes"
            )
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(self._fd, view, self._part.offset + self._written)
                self._hash.update(view[:n])
                self._written += n
                view = view[n:]
        except OSError as exc:
            self.discard()
            raise _disk_error(exc, f"part {self._part.number} of blob {self._blob}") from None

    def finish(self) -> None:
        """Keep the part if its length and digest match."""
        try:
            if self._written != self._part.length:
                raise IntegrityError(
                    f"part {self._part.number} of blob {self._blob} is truncated: got {self._written} bytes, "
                    f"expected {self._part.length}; send the whole part again"
                )
            actual = self._hash.hexdigest()
            if actual != self._part.sha256:
                raise IntegrityError(
                    f"part {self._part.number} of blob {self._blob} hashes to {actual}, but its chunk digest is "
                    f"{self._part.sha256}; the bytes were discarded: send the right bytes"
                )
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        tmp = self._marker.with_name(f".{self._marker.name}.{secrets.token_hex(4)}")
        tmp.write_text(f"{self._part.length} {self._part.sha256}", encoding="ascii")
        os.replace(tmp, self._marker)

    def discard(self) -> None:
        """Close without marking the part done."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalStore:
    """Origin store in a local directory (see the module docstring)."""

    kind = "local"

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        for sub in ("blobs/sha256", "manifests/sha256", "provenance/sha256", "labels", "staging", "tmp", "checksums"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        """``local:<root>``."""
        return f"local:{self.root}"

    def check_manifest(self, manifest: Manifest) -> None:
        """Any valid chunking works on disk."""

    # --- small objects --------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _link_once(self, source: Path, final: Path) -> bool:
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, final)
        except FileExistsError:
            return False
        finally:
            source.unlink(missing_ok=True)
        _fsync_dir(final.parent)
        return True

    def put_once(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` unless it exists."""
        final = self._path(key)
        if final.exists():
            return False
        tmp = self.root / "tmp" / secrets.token_hex(12)
        try:
            with open(tmp, "xb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _disk_error(exc, key) from None
        return self._link_once(tmp, final)

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        """Read a small object."""
        path = self._path(key)
        try:
            with open(path, "rb") as handle:
                data = handle.read(max_bytes + 1)
        except FileNotFoundError:
            raise NotFoundError(f"{key} is not in the store {self.describe()}") from None
        if len(data) > max_bytes:
            raise StoreError(f"{key} in {self.describe()} is larger than {max_bytes} bytes")
        return data

    def list_keys(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix``, skipping anything that is not a layout key."""
        base = self.root / prefix
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                key = (Path(dirpath) / name).relative_to(self.root).as_posix()
                try:
                    yield check_key(key)
                except ValidationError:
                    continue

    # --- blobs ----------------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> Path:
        """Where blob ``sha256`` lives on disk (whether or not it exists)."""
        return self._path(blob_key(sha256))

    def stat_blob(self, sha256: str) -> BlobStat | None:
        """Size of the blob, and the part size and composite checksum it was verified with."""
        try:
            size = self.blob_path(sha256).stat().st_size
        except FileNotFoundError:
            return None
        try:
            part_size, _, checksum = (self.root / "checksums" / sha256).read_text(encoding="ascii").partition(" ")
        except (FileNotFoundError, ValueError):
            return BlobStat(size=size, checksum=None)
        return BlobStat(size=size, checksum=checksum or None, part_size=int(part_size) if part_size.isdigit() else None)

    def read_blob(self, sha256: str) -> Iterator[bytes]:
        """The blob in 1 MiB pieces."""
        try:
            handle = open(self.blob_path(sha256), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise NotFoundError(f"blob {sha256} is not in the store {self.describe()}") from None
        with handle:
            while piece := handle.read(_READ_SIZE):
                yield piece

    # --- uploads --------------------------------------------------------------------------------

    def _staging(self, upload_id: str) -> Path:
        if not _UPLOAD_ID.fullmatch(upload_id):
            raise NotFoundError(f"upload {upload_id!r} does not exist")
        return self.root / "staging" / upload_id

    def _open_staging(self, sha256: str, upload_id: str) -> Path:
        staging = self._staging(upload_id)
        try:
            target = (staging / "target").read_text(encoding="ascii")
        except FileNotFoundError:
            raise NotFoundError(f"upload {upload_id} of blob {sha256} is gone (aborted or expired)") from None
        if target.split(" ")[0] != sha256:
            raise NotFoundError(f"upload {upload_id} is not an upload of blob {sha256}")
        return staging

    def begin_upload(self, sha256: str, part_size: int) -> str:
        """Create a staging directory with an empty blob file."""
        upload_id = secrets.token_hex(16)
        staging = self._staging(upload_id)
        try:
            (staging / "parts").mkdir(parents=True)
            (staging / "blob").touch()
            (staging / "target").write_text(f"{sha256} {part_size}", encoding="ascii")
        except OSError as exc:
            raise _disk_error(exc, f"staging of blob {sha256}") from None
        return upload_id

    def uploaded_parts(self, sha256: str, upload_id: str) -> dict[int, UploadedPart]:
        """Parts whose markers say they were received and verified."""
        staging = self._open_staging(sha256, upload_id)
        found: dict[int, UploadedPart] = {}
        for marker in (staging / "parts").iterdir():
            if not marker.name.isdigit():
                continue
            size, _, digest = marker.read_text(encoding="ascii").partition(" ")
            found[int(marker.name)] = UploadedPart(number=int(marker.name), size=int(size), sha256=digest)
        return found

    def part_target(self, sha256: str, upload_id: str, part: PartSpec, expires_in: int) -> PartTarget | None:
        """Parts go through the control plane (``open_part``)."""
        return None

    def open_part(self, sha256: str, upload_id: str, part: PartSpec) -> _LocalPartWriter:
        """A writer that streams the part into the staged blob."""
        staging = self._open_staging(sha256, upload_id)
        return _LocalPartWriter(staging / "blob", staging / "parts" / str(part.number), part, sha256)

    def complete_upload(self, sha256: str, upload_id: str, parts: Sequence[PartSpec]) -> bool:
        """Re-hash the staged blob and link it into place."""
        staging = self._open_staging(sha256, upload_id)
        check_uploaded(parts, self.uploaded_parts(sha256, upload_id), sha256)
        verifier = StreamVerifier(parts, sha256)
        blob_file = staging / "blob"
        with open(blob_file, "rb") as handle:
            while piece := handle.read(_READ_SIZE):
                verifier.feed(piece)
        try:
            verifier.finish(sha256)
        except IntegrityError:
            for number in verifier.bad_parts:
                (staging / "parts" / str(number)).unlink(missing_ok=True)
            raise
        with open(blob_file, "rb") as handle:
            os.fsync(handle.fileno())
        published = self._link_once(blob_file, self.blob_path(sha256))
        if published:
            part_size = (staging / "target").read_text(encoding="ascii").partition(" ")[2]
            record = self.root / "checksums" / sha256
            tmp = record.with_name(f".{sha256}.{secrets.token_hex(4)}")
            tmp.write_text(f"{part_size} {composite_checksum([p.sha256 for p in parts])}", encoding="ascii")
            os.replace(tmp, record)
        shutil.rmtree(staging, ignore_errors=True)
        event(log, "blob.published", store="local", blob=sha256, published=published)
        return published

    def abort_upload(self, sha256: str, upload_id: str) -> None:
        """Remove the staging directory."""
        try:
            staging = self._staging(upload_id)
        except NotFoundError:
            return
        shutil.rmtree(staging, ignore_errors=True)

    def read_url(self, sha256: str, expires_in: int) -> str | None:
        """The control plane serves local blobs itself, on signed URLs."""
        return None
