"""A version directory opened for loading.

Everything here costs no more than a header read per file: the manifest (checked against the
version digest when one is known), which safetensors files hold the model's weights (the HF
sharded index when there is one), the size and safetensors header of each weight file compared
with the manifest, the agent's verification record for ``verify="trust"``, and small side files
(``config.json``, the validation golden file) read whole and checked against their SHA-256.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpu_loader.errors import FileMismatchError, NotVerifiedError
from weightship.digests import is_hex, sha256_hex
from weightship.errors import ManifestError, NotFoundError
from weightship.layout import (
    MANIFEST_FILE,
    META_DIR,
    VERIFIED_FILE,
    VerificationRecord,
    read_verification,
    read_version_manifest,
)
from weightship.manifest import FileEntry, Manifest, parse_manifest
from weightship.safetensors_header import SafetensorsHeader, parse_header
from weightship.signing import directory_signatures, require_version
from weightship.signing_policy import SigningPolicy

__all__ = ["OpenFile", "Version", "open_version"]

#: Side files (configs, golden files) are read whole; anything bigger is not a side file.
MAX_SIDE_FILE = 64 * 1024 * 1024
_INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True, slots=True)
class OpenFile:
    """A weight file opened read-only whose size and header matched the manifest."""

    entry: FileEntry
    fd: int
    identity: tuple[int, int, int, int]


@dataclass(frozen=True)
class Version:
    """A version directory and its manifest."""

    directory: Path
    manifest: Manifest

    @property
    def digest(self) -> str:
        """The version id, ``sha256:<hex>``."""
        return self.manifest.digest

    def has_file(self, path: str) -> bool:
        """Whether the manifest lists ``path``."""
        return any(f.path == path for f in self.manifest.files)

    def read_file(self, path: str) -> bytes:
        """A small file of the version, read whole and checked against its SHA-256 in the manifest."""
        try:
            entry = self.manifest.file(path)
        except KeyError:
            raise NotFoundError(f"{path!r} is not part of version {self.digest} ({self.directory})") from None
        if entry.size > MAX_SIDE_FILE:
            raise FileMismatchError(
                f"{path!r} is {entry.size} bytes; side files are read whole, at most {MAX_SIDE_FILE}"
            )
        try:
            data = (self.directory / path).read_bytes()
        except FileNotFoundError:
            raise FileMismatchError(
                f"{path!r} is listed in the manifest of {self.digest} but missing from {self.directory}: re-fetch the version"
            ) from None
        if len(data) != entry.size or sha256_hex(data) != entry.sha256:
            raise FileMismatchError(
                f"{path!r} in {self.directory} ({len(data)} bytes) does not match its manifest entry "
                f"({entry.size} bytes, sha256 {entry.sha256[:12]}…): the version on disk is corrupt; re-fetch it"
            )
        return data

    def weight_files(self) -> tuple[FileEntry, ...]:
        """The safetensors files that hold the model's weights.

        The files named by a root-level ``*.safetensors.index.json`` (``model.safetensors.index.json``
        first) when there is one; else ``model.safetensors``; else every root-level safetensors file.
        """
        root = [f for f in self.manifest.files if "/" not in f.path]
        indexes = sorted(
            (f.path for f in root if f.path.endswith(_INDEX_SUFFIX)), key=lambda p: p != "model" + _INDEX_SUFFIX
        )
        if indexes:
            return self._indexed(indexes[0])
        safetensors = [f for f in root if f.safetensors is not None]
        preferred = [f for f in safetensors if f.path == "model.safetensors"]
        chosen = preferred or safetensors
        if not chosen:
            raise NotFoundError(f"version {self.digest} in {self.directory} holds no safetensors weight files")
        return tuple(chosen)

    def _indexed(self, index_path: str) -> tuple[FileEntry, ...]:
        try:
            weight_map = json.loads(self.read_file(index_path))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ManifestError(
                f"{index_path}: not a sharded-safetensors index (needs a 'weight_map' object)"
            ) from None
        entries: list[FileEntry] = []
        for shard in shards:
            try:
                entry = self.manifest.file(str(shard))
            except KeyError:
                raise ManifestError(f"{index_path} names shard {shard!r}, which the manifest does not list") from None
            if entry.safetensors is None:
                raise ManifestError(f"{index_path} names shard {shard!r}, which is not a safetensors file")
            entries.append(entry)
        return tuple(entries)

    def check_verification(self) -> VerificationRecord:
        """The agent's record that every chunk of this version was verified, or ``NotVerifiedError``."""
        record = read_verification(self.directory)
        where = self.directory / META_DIR / VERIFIED_FILE
        if record is None:
            raise NotVerifiedError(
                f"{where} is missing or unreadable: no agent has verified {self.digest}; "
                "load with verify='full' (or 'fast'), or wait until the agent reports the version ready"
            )
        chunks = sum(len(f.chunks) for f in self.manifest.files)
        if record.digest != self.digest:
            raise NotVerifiedError(f"{where} is for {record.digest}, not {self.digest}: the directory is inconsistent")
        if record.chunks_verified != chunks or record.bytes_verified != self.manifest.total_size:
            raise NotVerifiedError(
                f"{where} covers {record.chunks_verified} chunks / {record.bytes_verified} bytes, but {self.digest} "
                f"has {chunks} chunks / {self.manifest.total_size} bytes"
            )
        return record

    def open_files(self, entries: Sequence[FileEntry]) -> list[OpenFile]:
        """Open weight files, checking each one's size and safetensors header against the manifest."""
        opened: list[OpenFile] = []
        try:
            for entry in entries:
                opened.append(self._open(entry))
        except BaseException:
            for f in opened:
                os.close(f.fd)
            raise
        return opened

    def _open(self, entry: FileEntry) -> OpenFile:
        path = self.directory / entry.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise FileMismatchError(
                f"{entry.path!r} is missing from {self.directory}: re-fetch {self.digest}"
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_size != entry.size:
                kind = "truncated" if st.st_size < entry.size else "grown"
                raise FileMismatchError(
                    f"{entry.path!r} in {self.directory} is {st.st_size} bytes but the manifest of {self.digest} says "
                    f"{entry.size}: {kind} file; re-fetch the version"
                )
            if entry.safetensors is not None:
                _check_header(fd, entry, entry.safetensors)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(entry=entry, fd=fd, identity=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _check_header(fd: int, entry: FileEntry, expected: SafetensorsHeader) -> None:
    prefix = os.pread(fd, 8, 0)
    (header_len,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (-1,)
    if header_len != expected.header_len:
        raise FileMismatchError(
            f"{entry.path!r}: the safetensors header on disk is {header_len} bytes but the manifest says "
            f"{expected.header_len}: the file does not match the manifest; re-fetch the version"
        )
    raw = os.pread(fd, header_len, 8)
    if _same_header(raw, expected):
        return
    try:
        actual = parse_header(raw, header_len, entry.size, entry.path)
    except ManifestError as exc:
        raise FileMismatchError(f"{exc.message}; the manifest describes a valid file: re-fetch the version") from None
    if actual == expected:
        return
    on_disk = {t.name: t for t in actual.tensors}
    for tensor in expected.tensors:
        found = on_disk.get(tensor.name)
        if found != tensor:
            what = (
                "is missing" if found is None else f"is {found.dtype}{list(found.shape)} at {[found.begin, found.end]}"
            )
            raise FileMismatchError(
                f"tensor {tensor.name!r} in {entry.path!r} {what} on disk, but the manifest says "
                f"{tensor.dtype}{list(tensor.shape)} at {[tensor.begin, tensor.end]}: header and manifest disagree"
            )
    extra = sorted(set(on_disk) - {t.name for t in expected.tensors})
    detail = f"tensors {extra[:5]} are not in the manifest" if extra else "metadata differs"
    raise FileMismatchError(f"{entry.path!r}: safetensors header and manifest disagree: {detail}")


class _FloatLiteral(ValueError):
    pass


def _no_float(text: str) -> float:
    raise _FloatLiteral(text)


def _same_header(raw: bytes, expected: SafetensorsHeader) -> bool:
    """True only when ``parse_header(raw)`` would equal ``expected``; False sends to the full check.

    The full parse validates every entry in Python (~8 us a tensor, a few ms a load for ~1000
    tensors). The manifest's header already passed that validation for a file of this size, so an
    on-disk header with exactly its names, dtypes, shapes, offsets and metadata needs none. The
    equality must be exact: JSON ``true``/``false`` would equal 1/0 and floats would equal ints,
    so headers that contain them (anywhere, even inside a name) take the full path.
    """
    if b"true" in raw or b"false" in raw:
        return False
    try:
        doc = json.loads(raw.decode("utf-8"), parse_float=_no_float)
    except ValueError:  # not UTF-8 or JSON, or a float literal
        return False
    if (
        not isinstance(doc, dict)
        or doc.pop("__metadata__", {}) != expected.metadata
        or len(doc) != len(expected.tensors)
    ):
        return False
    for t in expected.tensors:
        if doc.get(t.name) != {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}:
            return False
    return True


def open_version(
    directory: str | os.PathLike[str],
    manifest: Manifest | None = None,
    digest: str | None = None,
    policy: SigningPolicy | None = None,
) -> Version:
    """Open a version directory; ``manifest`` defaults to the one stored in ``.weightship/``.

    The stored manifest is checked against ``digest``, or against the directory's name when that
    name is a digest's hex (the agent's layout ``versions/<hex>/``). With a signing ``policy`` the
    version must pass it with the signatures kept in the directory (``.weightship/signatures/``,
    written by the agent, or a top-level ``model.sig``); else ``SignatureRefused``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise NotFoundError(f"{root} is not a directory")
    if manifest is None:
        if digest is not None or is_hex(root.name):
            manifest = read_version_manifest(root, digest)
        else:
            path = root / META_DIR / MANIFEST_FILE
            try:
                manifest = parse_manifest(path.read_bytes())
            except FileNotFoundError:
                raise NotFoundError(
                    f"{path} is missing: {root} is not a weightship version directory; pass its manifest explicitly"
                ) from None
    elif digest is not None and manifest.digest != digest:
        raise ManifestError(f"the manifest given is {manifest.digest}, not the expected {digest}")
    if policy is not None:
        require_version(manifest, directory_signatures(root), policy.for_model(manifest.model))
    return Version(directory=root, manifest=manifest)
