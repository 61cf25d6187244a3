"""Assembling one version: a staging directory plus a journal of verified chunks (crash-safe).

``staging/<hex>/`` holds the version's files at their final relative paths, created sparse at
their final sizes, and ``.weightship/manifest.json``. A chunk's bytes are written to their place
only *after* their SHA-256 matched the manifest, and only then is a line appended to
``staging/<hex>.journal``::

    c <file-index> <chunk-index>      chunk verified and written
    f <file-index>                    whole file hard-linked from a ready version

After a kill -9 the journal names exactly the chunks already verified; a torn last line is
ignored (that chunk is fetched again). On resume each journaled chunk is read back and hashed
once more, so even a power loss that kept the journal line but not the data cannot let a bad
chunk through. When every chunk is in place the files are made read-only, the verification
record is written, and ``store.install`` renames the directory into ``versions/``: nothing is
ever visible as ready before every chunk was verified. Nothing is fsynced on that path: the
directory carries the unsynced marker from ``open`` on until ``agent.durability`` flushed it
(``finish(sync=True)`` flushes inline instead), and a restart hashes an unsynced version again.

A file of a ready version that its manifest says has the same sha256 is hard-linked (it is
immutable), but only once this node knows the bytes match *this* manifest: a sha256 is only what
some manifest claims, and a manifest that lies about it (a forged registry row, a buggy control
plane) must not smuggle its bytes into another version. So a file is linked without reading it
only when the ready version it comes from was verified under exactly this chunk geometry (same
chunk size and chunk digests); otherwise it is linked to a temporary name, hashed chunk by chunk
under this manifest, and put in place only if every chunk matches (else it is fetched). A chunk
that equals any chunk held locally is copied and re-verified. On resume, linked files are hashed
again too, like journaled chunks.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.durability import make_durable, mark_unsynced
from agent.durable import WRITE_BLOCK, atomic_write, disk_full_as_ours
from agent.store import LocalFile
from agent.verifier import first_bad_chunk, read_matches, verify_chunk
from weightship.digests import hex_of
from weightship.layout import MANIFEST_FILE, META_DIR, write_verification
from weightship.logs import event
from weightship.manifest import FileEntry, Manifest, check_relative_path

__all__ = ["ChunkJob", "Placement", "Staging"]

log = logging.getLogger("agent.staging")


@dataclass(frozen=True, slots=True)
class Placement:
    """One place a chunk's bytes go: chunk ``chunk`` of file ``file`` at ``offset``."""

    file: int
    chunk: int
    offset: int


@dataclass(slots=True)
class ChunkJob:
    """A distinct missing chunk: its digest, size, and every place it goes in this version."""

    digest: str
    length: int
    blob: str
    placements: list[Placement] = field(default_factory=list)

    @property
    def blob_offset(self) -> int:
        """Where the chunk starts in ``blob`` (the first placement's file)."""
        return self.placements[0].offset

    @property
    def bytes_placed(self) -> int:
        """Bytes this job writes into the version."""
        return self.length * len(self.placements)


class Staging:
    """One version being assembled; blocking methods, run them in a worker thread."""

    def __init__(self, staging_root: Path, manifest: Manifest) -> None:
        self.manifest = manifest
        self.hex = hex_of(manifest.digest)
        self.dir = staging_root / self.hex
        self.journal_path = staging_root / f"{self.hex}.journal"
        self.done: set[tuple[int, int]] = set()
        self.linked: set[int] = set()
        self._fds: dict[int, int] = {}
        self._journal_fd = -1
        self._lock = threading.Lock()  # place() runs in several worker threads at once

    # --- opening and resuming ------------------------------------------------------------------

    def open(self) -> None:
        """Create or reopen the staging directory and read the journal."""
        with disk_full_as_ours(f"staging area of {self.manifest.digest}"):
            (self.dir / META_DIR).mkdir(parents=True, exist_ok=True)
            manifest_path = self.dir / META_DIR / MANIFEST_FILE
            if not manifest_path.exists() or manifest_path.read_bytes() != self.manifest.raw:
                atomic_write(manifest_path, self.manifest.raw)
            mark_unsynced(self.dir)  # durable before the first chunk lands (``agent.durability``)
            self._read_journal()
            self._journal_fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for index, entry in enumerate(self.manifest.files):
                if index not in self.linked:
                    self._open_file(index, check_relative_path(entry.path), entry.size)

    def _read_journal(self) -> None:
        try:
            text = self.journal_path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        files = self.manifest.files
        for line in text.split("\n")[:-1]:  # the part after the last newline may be torn
            parts = line.split()
            try:
                if parts[0] == "c" and len(parts) == 3:
                    f, c = int(parts[1]), int(parts[2])
                    if 0 <= f < len(files) and 0 <= c < len(files[f].chunks):
                        self.done.add((f, c))
                elif parts[0] == "f" and len(parts) == 2 and 0 <= int(parts[1]) < len(files):
                    self.linked.add(int(parts[1]))
            except (IndexError, ValueError):
                continue

    def _open_file(self, index: int, rel: str, size: int) -> None:
        path = self.dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or (path.exists() and path.stat().st_nlink > 1):
            # A hard link whose journal line was lost in a crash: never write through it.
            path.unlink()
            self.done -= {(index, c) for c in range(len(self.manifest.files[index].chunks))}
        if path.exists() and not os.access(path, os.W_OK):
            path.chmod(0o644)  # made read-only by a finish() that a crash cut short
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)  # sparse: blocks are allocated as chunks land
        self._fds[index] = fd

    def reverify(self) -> int:
        """Hash every journaled chunk again from disk; forget those that fail. Returns how many failed."""
        chunk_size = self.manifest.chunk_size
        buf = bytearray(min(chunk_size, max((f.size for f in self.manifest.files), default=1)) or 1)
        failed = 0
        # A linked file replaced whatever chunks had been placed in that file before.
        self.done = {(f, c) for f, c in self.done if f not in self.linked}
        for f, c in sorted(self.done):
            entry = self.manifest.files[f]
            start, end = entry.chunk_range(c, chunk_size)
            if not read_matches(self._fds[f], start, end - start, entry.chunks[c], buf):
                self.done.discard((f, c))
                failed += 1
        for f in sorted(self.linked):
            entry = self.manifest.files[f]
            if not self._linked_file_matches(entry):
                # E.g. a power loss kept the journal line but not the rename: the sparse file is there.
                self.linked.discard(f)
                (self.dir / entry.path).unlink(missing_ok=True)  # never write through a link
                self._open_file(f, entry.path, entry.size)
                failed += 1
        if failed:
            event(log, "staging.reverify_failed", logging.WARNING, digest=self.manifest.digest, chunks=failed)
        return failed

    # --- filling -------------------------------------------------------------------------------

    def _linked_file_matches(self, entry: FileEntry) -> bool:
        try:
            fd = os.open(self.dir / entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            return first_bad_chunk(fd, entry, self.manifest.chunk_size) is None
        finally:
            os.close(fd)

    def _same_geometry(self, source: LocalFile, entry: FileEntry) -> bool:
        """Whether this node verified ``source`` under exactly ``entry``'s chunk digests and size."""
        return source.chunk_size == self.manifest.chunk_size and source.chunks == entry.chunks

    def link_identical(self, files: Mapping[str, Sequence[LocalFile]]) -> int:
        """Hard-link every missing file a ready version holds with bytes that match this manifest; bytes linked.

        Candidates come by the sha256 their manifests claim; each is trusted only as described
        in the module docstring (same geometry, or hashed now under this one).
        """
        linked = 0
        for index, entry in enumerate(self.manifest.files):
            if index in self.linked or self._complete(index):
                continue
            # Those verified under this very geometry first: they need no reading.
            candidates = sorted(files.get(entry.sha256, ()), key=lambda c: not self._same_geometry(c, entry))
            for source in candidates:
                if self._link(index, entry, source):
                    linked += entry.size
                    break
        return linked

    def _link(self, index: int, entry: FileEntry, source: LocalFile) -> bool:
        target = self.dir / entry.path
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.link")
        try:
            os.link(source.path, tmp)
        except OSError:
            return False  # other file system, or links not allowed: the chunks get copied instead
        try:
            if not self._same_geometry(source, entry):
                # Hash the link itself: the very inode that would be served.
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    bad = first_bad_chunk(fd, entry, self.manifest.chunk_size)
                finally:
                    os.close(fd)
                if bad is not None:
                    event(
                        log,
                        "staging.link_refused",
                        logging.WARNING,
                        digest=self.manifest.digest,
                        file=entry.path,
                        source=str(source.path),
                        chunk_index=bad,
                        reason="bytes do not match this manifest's chunk digests; fetching the file instead",
                    )
                    return False
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        os.close(self._fds.pop(index))
        self.linked.add(index)
        self.done -= {(index, c) for c in range(len(entry.chunks))}
        self._journal(f"f {index}\n")
        return True

    def _complete(self, index: int) -> bool:
        return all((index, c) in self.done for c in range(len(self.manifest.files[index].chunks)))

    def jobs(self) -> list[ChunkJob]:
        """The distinct chunks still missing, each with every place it goes."""
        by_digest: dict[str, ChunkJob] = {}
        chunk_size = self.manifest.chunk_size
        for f, entry in enumerate(self.manifest.files):
            if f in self.linked:
                continue
            for c, digest in enumerate(entry.chunks):
                if (f, c) in self.done:
                    continue
                start, end = entry.chunk_range(c, chunk_size)
                job = by_digest.get(digest)
                if job is None:
                    job = by_digest[digest] = ChunkJob(digest=digest, length=end - start, blob=entry.sha256)
                job.placements.append(Placement(file=f, chunk=c, offset=start))
        return list(by_digest.values())

    def own_chunks(self) -> dict[str, tuple[Path, int, int]]:
        """Chunks already verified in this staging directory, readable as local sources."""
        found: dict[str, tuple[Path, int, int]] = {}
        for f, c in self.done:
            entry = self.manifest.files[f]
            start, end = entry.chunk_range(c, self.manifest.chunk_size)
            found.setdefault(entry.chunks[c], (self.dir / entry.path, start, end - start))
        return found

    def bytes_present(self) -> int:
        """Bytes of the version already verified in place."""
        total = sum(self.manifest.files[f].size for f in self.linked)
        for f, c in self.done:
            if f not in self.linked:
                start, end = self.manifest.files[f].chunk_range(c, self.manifest.chunk_size)
                total += end - start
        return total

    def place(self, job: ChunkJob, data: memoryview) -> None:
        """Verify ``data`` against ``job.digest``, then write it to every place and journal it.

        Raises ``IntegrityError`` (nothing written) if the bytes do not match. Nothing is fsynced
        here: the version is flushed once, after it is ready (``agent.durability``).
        """
        entry = self.manifest.files[job.placements[0].file]
        verify_chunk(data, job.digest, f"chunk {job.placements[0].chunk} of {entry.path} in {self.manifest.digest}")
        with disk_full_as_ours(f"{entry.path} of {self.manifest.digest}"):
            for p in job.placements:
                done = 0
                while done < job.length:
                    piece = data[done : min(job.length, done + WRITE_BLOCK)]
                    done += os.pwrite(self._fds[p.file], piece, p.offset + done)
            with self._lock:
                self._journal("".join(f"c {p.file} {p.chunk}\n" for p in job.placements))
                self.done.update((p.file, p.chunk) for p in job.placements)

    def _journal(self, lines: str) -> None:
        os.write(self._journal_fd, lines.encode("ascii"))

    # --- finishing -----------------------------------------------------------------------------

    def finish(self, sync: bool = True) -> Path:
        """Make every file read-only and write the verification record; with ``sync``, flush it all first.

        Without ``sync`` the directory keeps its unsynced marker for ``agent.durability.Flusher``.
        Call only when ``jobs()`` is empty; returns the directory to install.
        """
        missing = self.jobs()
        if missing:
            raise RuntimeError(f"{len(missing)} chunks of {self.manifest.digest} are still missing")
        with disk_full_as_ours(f"verification record of {self.manifest.digest}"):
            for fd in self._fds.values():
                os.fchmod(fd, 0o444)
            self.close()
            write_verification(self.dir, self.manifest)
            if sync:
                make_durable(self.dir)
        return self.dir

    def close(self) -> None:
        """Close every open file (the staging directory stays for a later resume)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1

    def discard_journal(self) -> None:
        """Remove the journal once the version is installed."""
        self.journal_path.unlink(missing_ok=True)
