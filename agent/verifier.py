"""Verification: every chunk is checked against the manifest before it is placed or trusted.

Bytes from the network, from a peer or from another local version are all treated the same:
their SHA-256 must equal the chunk digest in the manifest, whose own digest is the version id.
A whole file found locally by its sha256 is no exception: that sha256 is only what some
manifest claims, so the file is hashed again under the new manifest's chunk geometry
(``first_bad_chunk``) unless this node already verified it under exactly that geometry.
A ready version directory is trusted only if its manifest hashes to its name, the agent's
verification record names the same digest, and every file has the manifest's size.
"""

from __future__ import annotations

import os
from pathlib import Path

from weightship.buffers import read_exact
from weightship.digests import format_digest, hex_of, sha256_hex, sha256_stream
from weightship.errors import IntegrityError
from weightship.layout import read_verification, read_version_manifest
from weightship.manifest import FileEntry, Manifest

__all__ = ["bad_chunks", "check_version_dir", "chunk_matches", "first_bad_chunk", "read_matches", "verify_chunk"]

#: bytes read at a time when a whole file is hashed chunk by chunk
READ_BLOCK = 4 * 1024 * 1024


def chunk_matches(data: bytes | bytearray | memoryview, expected_hex: str) -> bool:
    """Whether ``data`` hashes to ``expected_hex``."""
    return sha256_hex(data) == expected_hex


def verify_chunk(data: bytes | bytearray | memoryview, expected_hex: str, what: str) -> None:
    """Raise ``IntegrityError`` unless ``data`` hashes to ``expected_hex``."""
    actual = sha256_hex(data)
    if actual != expected_hex:
        raise IntegrityError(
            f"{what}: {len(data)} bytes hash to sha256:{actual[:16]}…, the manifest says sha256:{expected_hex[:16]}…; "
            "the bytes were rejected and will be fetched again"
        )


def read_matches(fd: int, offset: int, length: int, expected_hex: str, buf: bytearray) -> bool:
    """Whether the ``length`` bytes at ``offset`` of ``fd`` hash to ``expected_hex`` (read into ``buf``)."""
    view = memoryview(buf)[:length]
    try:
        read_exact(fd, view, offset)
    except IntegrityError:  # shorter than the manifest says: not the bytes we want
        return False
    return chunk_matches(view, expected_hex)


def first_bad_chunk(fd: int, entry: FileEntry, chunk_size: int) -> int | None:
    """The first chunk of open file ``fd`` that does not hash to ``entry``'s digest at ``chunk_size``.

    ``None`` when every chunk matches; chunk 0 when the file does not have ``entry.size`` bytes.
    Reads in ``READ_BLOCK`` pieces, so a 4 GiB chunk needs no 4 GiB buffer.
    """
    if os.fstat(fd).st_size != entry.size:
        return 0
    buf = memoryview(bytearray(min(READ_BLOCK, max(entry.size, 1))))
    for index, expected in enumerate(entry.chunks):
        start, end = entry.chunk_range(index, chunk_size)
        hasher = sha256_stream()
        while start < end:
            n = os.preadv(fd, [buf[: min(len(buf), end - start)]], start)
            if n == 0:
                return index
            hasher.update(buf[:n])
            start += n
        if hasher.hexdigest() != expected:
            return index
    return None


def bad_chunks(directory: Path, manifest: Manifest) -> dict[int, set[int]]:
    """Every chunk of the files under ``directory`` that does not hash to ``manifest``'s digest, by file index.

    A file that is missing or has the wrong size counts as bad in every chunk.
    """
    bad: dict[int, set[int]] = {}
    buf = memoryview(bytearray(min(READ_BLOCK, max((f.size for f in manifest.files), default=1)) or 1))
    for index, entry in enumerate(manifest.files):
        try:
            fd = os.open(directory / entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            bad[index] = set(range(len(entry.chunks)))
            continue
        try:
            if os.fstat(fd).st_size != entry.size:
                bad[index] = set(range(len(entry.chunks)))
                continue
            for c, expected in enumerate(entry.chunks):
                start, end = entry.chunk_range(c, manifest.chunk_size)
                hasher = sha256_stream()
                while start < end:
                    n = os.preadv(fd, [buf[: min(len(buf), end - start)]], start)
                    if n == 0:
                        break
                    hasher.update(buf[:n])
                    start += n
                if start < end or hasher.hexdigest() != expected:
                    bad.setdefault(index, set()).add(c)
        finally:
            os.close(fd)
    return bad


def check_version_dir(directory: Path, digest: str | None = None) -> Manifest:
    """The manifest of a ready version directory, or ``IntegrityError`` saying what is wrong."""
    manifest = read_version_manifest(directory, digest)
    record = read_verification(directory)
    expected = format_digest(hex_of(digest or directory.name))
    if record is None or record.digest != expected:
        raise IntegrityError(f"{directory} has no verification record for {expected}: it was never fully verified")
    for entry in manifest.files:
        path = directory / entry.path
        try:
            size = path.lstat().st_size
        except FileNotFoundError:
            raise IntegrityError(f"{directory}: file {entry.path} is missing") from None
        if not path.is_file() or path.is_symlink() or size != entry.size:
            raise IntegrityError(f"{directory}: file {entry.path} is {size} bytes, the manifest says {entry.size}")
    return manifest
