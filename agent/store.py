"""The local version store: versions side by side on disk, and per-deployment ``current`` links.

Layout under the data directory::

    versions/<hex>/                  ready versions, read-only, named by version digest
    versions/<hex>/.weightship/      manifest.json (bytes as published) + verified.json
    staging/<hex>/                   versions being assembled (see ``staging.py``)
    staging/<hex>.journal            the verified chunks of a staging directory
    deployments/<name>/current  ->  ../../versions/<hex>   what a deployment serves
    state/deployments.json           accepted/applied epochs (see ``epochs.py``)
    state/last_used.json             when each version was last referenced (LRU order)
    trash/                           versions being deleted; emptied at start-up
    agent.json                       this run: pid, local API address, node id

A version appears under ``versions/`` only by an atomic rename of a fully verified staging
directory, so anything found there at start-up was complete; start-up still checks each one
(manifest digest, verification record, file sizes) and moves anything wrong to ``trash/``. A
version that was ready but not yet flushed to disk (``agent.durability``) is hashed again first.
Two deployments serving the same digest share one directory: a version is stored once.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agent.durability import is_unsynced, settle
from agent.durable import atomic_symlink, atomic_write, fsync_dir
from agent.verifier import check_version_dir
from weightship.digests import format_digest, hex_of, is_hex
from weightship.errors import NotFoundError, WeightshipError
from weightship.layout import version_dir
from weightship.logs import event
from weightship.manifest import Manifest, check_model_name

__all__ = ["LocalChunk", "LocalFile", "VersionStore"]

log = logging.getLogger("agent.store")

#: where a chunk's bytes can be read locally: (file, offset, length)
LocalChunk = tuple[Path, int, int]


@dataclass(frozen=True, slots=True)
class LocalFile:
    """A file of a ready version, and the chunk geometry this node verified it under.

    Its sha256 (the key it is found by) is only what its manifest claims; what this node knows
    is that the bytes hash to ``chunks`` at ``chunk_size``.
    """

    path: Path
    chunk_size: int
    chunks: tuple[str, ...]


class VersionStore:
    """Ready versions, ``current`` links and the LRU record of one data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir).resolve()
        self.versions_dir = self.root / "versions"
        self.staging_dir = self.root / "staging"
        self.deployments_dir = self.root / "deployments"
        self.state_dir = self.root / "state"
        self.trash_dir = self.root / "trash"
        for d in (self.versions_dir, self.staging_dir, self.deployments_dir, self.state_dir, self.trash_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._ready: dict[str, Manifest] = {}
        self._last_used: dict[str, float] = {}
        self._chunks: dict[str, LocalChunk] | None = None
        self._files: dict[str, list[LocalFile]] | None = None
        # Retention evicts from a worker thread while the event loop reads; one lock for both,
        # held only for in-memory steps: the event loop takes it, so never across a disk flush.
        self._lock = threading.RLock()
        # Orders writes of last_used.json; taken only in worker threads, never by the event loop.
        self._save_lock = threading.Lock()
        self._last_used_seq = 0
        self._saved_seq = 0

    # --- start-up ------------------------------------------------------------------------------

    def recover(self) -> None:
        """Empty the trash and load every ready version, setting aside any that fails its checks."""
        for entry in self.trash_dir.iterdir():
            _remove_tree(entry)
        for entry in sorted(self.versions_dir.iterdir()):
            if entry.name.startswith("."):
                _remove_tree(entry)
                continue
            try:
                if not is_hex(entry.name) or not entry.is_dir() or entry.is_symlink():
                    raise NotFoundError(f"{entry} is not a version directory")
                manifest = check_version_dir(entry)
            except WeightshipError as exc:
                event(log, "store.version_discarded", logging.WARNING, path=str(entry), reason=exc.message)
                self._discard(entry)
                continue
            if is_unsynced(entry):
                # Ready but maybe not on the disk when the agent stopped: hashed again before it is trusted.
                try:
                    if not settle(entry, manifest, self.staging_dir):
                        continue
                except OSError as exc:
                    event(log, "store.version_discarded", logging.WARNING, path=str(entry), reason=str(exc))
                    self._discard(entry)
                    continue
            self._ready[manifest.digest] = manifest
        for leftover in self.staging_dir.iterdir():
            # A crash between the rename into versions/ and the journal's removal leaves these.
            stem = leftover.name.removesuffix(".journal")
            if not is_hex(stem) or format_digest(stem) in self._ready:
                _remove_tree(leftover)
        for link_dir in self.deployments_dir.iterdir():
            for tmp in link_dir.glob(".current.*.tmp"):
                tmp.unlink()
        path = self.state_dir / "last_used.json"
        if path.exists():
            self._last_used = {k: float(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
        self._invalidate()
        event(log, "store.recovered", versions=len(self._ready), root=str(self.root))

    # --- ready versions ------------------------------------------------------------------------

    def is_ready(self, digest: str) -> bool:
        """Whether ``digest`` is fully verified on disk."""
        return digest in self._ready

    def ready(self) -> dict[str, Manifest]:
        """Every ready version, by digest."""
        with self._lock:
            return dict(self._ready)

    def path(self, digest: str) -> Path:
        """The directory of version ``digest`` (ready or not)."""
        return version_dir(self.root, digest)

    def install(self, staged: Path, manifest: Manifest, sync: bool = True) -> Path:
        """Rename a fully verified staging directory into ``versions/`` (atomic; durable with ``sync``).

        Without ``sync`` the directory carries its unsynced marker, and ``agent.durability``
        makes the rename durable with the rest.
        """
        final = self.path(manifest.digest)
        if final.exists():
            # Another fetch of the same digest finished first; the bytes are identical.
            self._discard(staged)
        else:
            os.rename(staged, final)
            if sync:
                fsync_dir(self.versions_dir)
        with self._lock:
            self._ready[manifest.digest] = manifest
            self._invalidate()
        self.touch([manifest.digest])
        event(log, "store.installed", digest=manifest.digest, bytes=manifest.total_size)
        return final

    def remove(self, digest: str) -> None:
        """Delete version ``digest``; callers make sure nothing references it."""
        with self._lock:
            self._ready.pop(digest, None)
            self._invalidate()
            self._last_used.pop(digest, None)
        self._save_last_used()
        final = self.path(digest)
        if final.exists():
            self._discard(final)

    def staged(self) -> dict[str, float]:
        """Versions with a staging area (partly fetched), by digest, with when it last changed."""
        found: dict[str, float] = {}
        for entry in self.staging_dir.iterdir():
            if entry.is_dir() and is_hex(entry.name):
                journal = self.staging_dir / f"{entry.name}.journal"
                found[format_digest(entry.name)] = (journal if journal.exists() else entry).stat().st_mtime
        return found

    def remove_staging(self, digest: str) -> None:
        """Delete the staging area of ``digest`` and its journal; callers make sure no fetch uses it."""
        name = hex_of(digest)
        (self.staging_dir / f"{name}.journal").unlink(missing_ok=True)
        if (self.staging_dir / name).exists():
            self._discard(self.staging_dir / name)

    def _discard(self, directory: Path) -> None:
        # A rename is atomic, so a crash leaves the directory either in place or in the trash.
        target = self.trash_dir / f"{directory.name}.{secrets.token_hex(4)}"
        os.rename(directory, target)
        _remove_tree(target)

    def local_chunks(self) -> dict[str, LocalChunk]:
        """Where each chunk digest held by a ready version can be read."""
        with self._lock:
            return self._local_chunks()

    def _local_chunks(self) -> dict[str, LocalChunk]:
        if self._chunks is None:
            found: dict[str, LocalChunk] = {}
            for digest, manifest in self._ready.items():
                base = self.path(digest)
                for entry in manifest.files:
                    for index, chunk in enumerate(entry.chunks):
                        start, end = entry.chunk_range(index, manifest.chunk_size)
                        found.setdefault(chunk, (base / entry.path, start, end - start))
            self._chunks = found
        return self._chunks

    def local_files(self) -> dict[str, list[LocalFile]]:
        """Every file of a ready version, by the sha256 its manifest claims (several may claim one)."""
        with self._lock:
            return self._local_files()

    def _local_files(self) -> dict[str, list[LocalFile]]:
        if self._files is None:
            found: dict[str, list[LocalFile]] = {}
            for digest, manifest in sorted(self._ready.items()):
                for entry in manifest.files:
                    if entry.size > 0:
                        local = LocalFile(self.path(digest) / entry.path, manifest.chunk_size, entry.chunks)
                        found.setdefault(entry.sha256, []).append(local)
            self._files = found
        return self._files

    def _invalidate(self) -> None:
        self._chunks = None
        self._files = None

    # --- deployments ---------------------------------------------------------------------------

    def link_current(self, deployment: str, digest: str) -> None:
        """Point ``deployments/<deployment>/current`` at version ``digest`` atomically."""
        if digest not in self._ready:
            raise NotFoundError(f"version {digest} is not ready on this node; it cannot be served")
        link_dir = self.deployments_dir / check_model_name(deployment)
        link_dir.mkdir(exist_ok=True)
        atomic_symlink(link_dir / "current", f"../../versions/{hex_of(digest)}")

    def current(self, deployment: str) -> str | None:
        """The digest ``deployment``'s ``current`` link points at, if any."""
        try:
            target = os.readlink(self.deployments_dir / deployment / "current")
        except OSError:
            return None
        name = Path(target).name
        return format_digest(name) if is_hex(name) else None

    # --- LRU and usage -------------------------------------------------------------------------

    def touch(self, digests: list[str]) -> None:
        """Record that ``digests`` are referenced now (they become the most recently used).

        Writes ``state/last_used.json`` durably: call it from a worker thread, not the event loop.
        """
        now = time.time()
        with self._lock:
            for digest in digests:
                self._last_used[digest] = now
        self._save_last_used()

    def last_used(self, digest: str) -> float:
        """When ``digest`` was last referenced (0 if never)."""
        return self._last_used.get(digest, 0.0)

    def _save_last_used(self) -> None:
        # Snapshot under the shared lock, flush outside it; a snapshot older than one already on
        # disk is dropped, so concurrent savers never put an older record back.
        with self._lock:
            self._last_used_seq += 1
            seq = self._last_used_seq
            data = json.dumps(self._last_used, sort_keys=True).encode()
        with self._save_lock:
            if seq > self._saved_seq:
                atomic_write(self.state_dir / "last_used.json", data)
                self._saved_seq = seq

    def usage_bytes(self) -> int:
        """Bytes on disk under ``versions/`` and ``staging/``, each hard-linked inode counted once."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for top in (self.versions_dir, self.staging_dir):
            for dirpath, _dirs, files in os.walk(top):
                for name in files:
                    try:
                        st = os.lstat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    key = (st.st_dev, st.st_ino)
                    if key not in seen:
                        seen.add(key)
                        total += st.st_blocks * 512
        return total

    def disk_free(self) -> tuple[int, int]:
        """``(total, free)`` bytes of the data directory's file system."""
        usage = shutil.disk_usage(self.root)
        return usage.total, usage.free


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
