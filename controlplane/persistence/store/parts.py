"""Parts of a blob upload: their geometry, and checking what a store holds against the manifest.

Part ``n`` of a blob is chunk ``n - 1`` of the file, so the manifest's chunk digests are exactly
the part digests a store must end up with. Three ways to check them, cheapest first:

1. per-part SHA-256 checksums the store reports before completion (S3 ``ListParts``);
2. the composite checksum of a completed multipart object (``base64(sha256(d1 || d2 || ...))``
   over the raw part digests), which the store computes from the bytes it holds;
3. a streaming re-hash of the bytes (``StreamVerifier``): every chunk and the whole file.

Only 3 checks a blob's *name*: part checksums say nothing about the whole-file SHA-256 of a blob
of several chunks, so every such blob is re-hashed once before it is published (``S3Store``
hashes the staged object; ``LocalStore`` the staged file), and ``verify_stored`` re-hashes a
stored blob under a chunk size it was never verified with. Each needs no more memory than one
read buffer.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

from controlplane.persistence.store.origin import BlobStat, OriginStore, PartSpec, UploadedPart
from weightship.chunks import chunk_ranges
from weightship.digests import sha256_hex, sha256_stream
from weightship.errors import ConflictError, IntegrityError
from weightship.manifest import FileEntry

__all__ = [
    "StreamVerifier",
    "b64_of_hex",
    "check_uploaded",
    "composite_checksum",
    "hex_of_b64",
    "normalize_checksum",
    "plan_parts",
    "stat_matches",
    "verify_stored",
]


def plan_parts(entry: FileEntry, chunk_size: int) -> list[PartSpec]:
    """The parts of ``entry``'s blob: one per chunk, numbered from 1."""
    return [
        PartSpec(number=i + 1, offset=start, length=end - start, sha256=entry.chunks[i])
        for i, (start, end) in enumerate(chunk_ranges(entry.size, chunk_size))
    ]


def b64_of_hex(hex_digest: str) -> str:
    """The base64 form S3 uses for a SHA-256 (``x-amz-checksum-sha256``)."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode("ascii")


def hex_of_b64(value: str) -> str | None:
    """Hex of a base64 SHA-256, or ``None`` if ``value`` is not one."""
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 32 else None


def normalize_checksum(value: str | None) -> str | None:
    """A checksum without S3's ``-<parts>`` suffix on composite checksums (base64 has no '-')."""
    if not value:
        return None
    return value.split("-", 1)[0]


def composite_checksum(chunks: Sequence[str]) -> str:
    """S3's COMPOSITE SHA-256 of a multipart object whose parts have the digests ``chunks`` (hex)."""
    joined = b"".join(bytes.fromhex(c) for c in chunks)
    return b64_of_hex(sha256_hex(joined))


def stat_matches(stat: BlobStat, entry: FileEntry, chunk_size: int) -> bool:
    """Whether a stored blob can be the one ``entry`` describes, judged without reading it.

    Size must agree. Where the store keeps a checksum it must be, for a file of at most one
    chunk, its plain SHA-256 or the one-part composite; for a blob stored in parts of this
    manifest's chunk size, the composite of the entry's chunk digests. A blob stored in parts of
    another size says nothing about these chunks, so only its size is compared.
    """
    if stat.size != entry.size:
        return False
    checksum = normalize_checksum(stat.checksum)
    if checksum is None:
        return True
    if len(entry.chunks) <= 1 and checksum in (b64_of_hex(entry.sha256), composite_checksum(entry.chunks)):
        return True
    if stat.part_size is not None and stat.part_size != chunk_size:
        return True
    return checksum == composite_checksum(entry.chunks)


def check_uploaded(parts: Sequence[PartSpec], uploaded: Mapping[int, UploadedPart], blob: str) -> None:
    """Refuse to complete unless every part is there with the right size (and digest, if known).

    A part of the wrong size or digest is an ``IntegrityError`` (re-upload it); a part that was
    never uploaded is a ``ConflictError`` (upload it, then commit again).
    """
    wrong: list[str] = []
    missing: list[int] = []
    for part in parts:
        held = uploaded.get(part.number)
        if held is None:
            missing.append(part.number)
        elif held.size != part.length:
            wrong.append(f"part {part.number} has {held.size} bytes, expected {part.length}")
        elif held.sha256 is not None and held.sha256 != part.sha256:
            wrong.append(f"part {part.number} hashes to {held.sha256}, expected {part.sha256}")
    if wrong:
        raise IntegrityError(
            f"blob {blob}: {'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; "
            "upload those parts again with the right bytes, then commit"
        )
    if missing:
        shown = ", ".join(str(n) for n in missing[:20])
        raise ConflictError(
            f"blob {blob} is incomplete: parts {shown}{' ...' if len(missing) > 20 else ''} "
            f"({len(missing)} of {len(parts)}) were never uploaded; upload them, then commit again"
        )


class StreamVerifier:
    """Hashes a blob's bytes as they stream past: every chunk (unless ``chunks`` is off) and the whole file.

    ``chunks=False`` is for bytes whose chunk digests a store checksum already covers, so each
    byte is hashed once, for the whole-file digest.
    """

    def __init__(self, parts: Sequence[PartSpec], sha256: str, *, chunks: bool = True) -> None:
        self._parts = list(parts)
        self._sha256 = sha256
        self._chunks = chunks
        self._whole = sha256_stream()
        self._index = 0
        self._chunk = sha256_stream()
        self._in_chunk = 0
        self._total = 0
        #: ``(part number, the digest its bytes have)`` of each part that does not match
        self.mismatches: list[tuple[int, str]] = []

    @property
    def bad_parts(self) -> list[int]:
        """Numbers of the parts whose bytes do not match their chunk digests."""
        return [number for number, _ in self.mismatches]

    def feed(self, data: bytes | memoryview) -> None:
        """Account for the next bytes of the blob."""
        view = memoryview(data)
        self._whole.update(view)
        self._total += len(view)
        while view and self._chunks:
            if self._index >= len(self._parts):
                return  # longer than expected; finish() reports the size
            part = self._parts[self._index]
            take = min(len(view), part.length - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == part.length:
                actual = self._chunk.hexdigest()
                if actual != part.sha256:
                    self.mismatches.append((part.number, actual))
                self._index += 1
                self._chunk = sha256_stream()
                self._in_chunk = 0

    def finish(self, blob: str) -> None:
        """Raise ``IntegrityError`` unless size, every chunk and the whole-file digest matched."""
        expected = sum(p.length for p in self._parts)
        if self._total != expected:
            raise IntegrityError(f"blob {blob} holds {self._total} bytes, the manifest says {expected}")
        if self.mismatches:
            shown = ", ".join(str(n) for n in self.bad_parts[:20])
            raise IntegrityError(
                f"blob {blob}: parts {shown} do not match their chunk digests; upload them again, then commit"
            )
        actual = self._whole.hexdigest()
        if actual != self._sha256:
            raise IntegrityError(
                f"blob {blob}: every chunk matches but the whole file hashes to {actual}; the manifest's "
                "file sha256 is wrong: rebuild the manifest from the files and publish again"
            )


def verify_stored(store: OriginStore, entry: FileEntry, chunk_size: int) -> None:
    """Hash every byte of stored blob ``entry.sha256`` under ``chunk_size``: each chunk and the whole file.

    For a manifest that names a blob the store already holds under a chunk size nobody verified
    it with. ``IntegrityError`` names the file, the blob and the first chunk that differs.
    """
    parts = plan_parts(entry, chunk_size)
    verifier = StreamVerifier(parts, entry.sha256)
    for piece in store.read_blob(entry.sha256):
        verifier.feed(piece)
    try:
        verifier.finish(entry.sha256)
    except IntegrityError as exc:
        if not verifier.mismatches:
            raise IntegrityError(f"{entry.path}: {exc.message}") from None
        number, actual = verifier.mismatches[0]
        raise IntegrityError(
            f"{entry.path}: the store's blob {entry.sha256} hashed under chunk size {chunk_size} differs from "
            f"this manifest at chunk {number - 1} (bytes {parts[number - 1].offset}+{parts[number - 1].length}): "
            f"it hashes to {actual}, the manifest states {parts[number - 1].sha256} "
            f"({len(verifier.mismatches)} chunks differ); the manifest does not describe these bytes: rebuild it "
            "from the files and publish again"
        ) from None
