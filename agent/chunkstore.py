"""A cache's chunk store: verified chunks on disk by digest, crash-safe, bounded with LRU and pins.

Layout under ``<data_dir>/chunks/``: ``<first two hex>/<chunk sha256 hex>``, one read-only file
per chunk. A chunk is stored only after its SHA-256 matched its name, through
``agent.durable.atomic_write`` (temporary name, fsync, rename, fsync of the directory): a file
under its final name is therefore whole and verified, and a cache killed at any point restarts
with every chunk it had finished storing (``recover`` deletes leftover temporary files and loads
the rest). Nothing is re-hashed at start-up: only verified bytes ever get a final name.

Bound: with ``capacity`` > 0, storing a chunk first evicts least recently used chunks (by last
store or serve; after a restart, by file modification time) that are not *pinned*: the chunks of
every version some serving pointer names (the cache's refresh loop sets them). If pinned chunks
alone fill the store, the new chunk is kept anyway and ``cache.over_capacity`` is logged: a
pointer's versions must stay servable; raise ``--cache-bytes``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

from agent.durable import atomic_write
from weightship.digests import is_hex
from weightship.logs import event

__all__ = ["ChunkStore"]

log = logging.getLogger("agent.chunkstore")


class ChunkStore:
    """Verified chunks by digest under ``root``; blocking methods (run ``put``/``recover`` in a worker)."""

    def __init__(self, root: Path, capacity: int = 0) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._used = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def path(self, digest: str) -> Path:
        """Where chunk ``digest`` lives (whether held or not)."""
        return self.root / digest[:2] / digest

    def recover(self) -> int:
        """Delete temporary files left by a crash and load the stored chunks; returns how many."""
        found: list[tuple[float, str, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in sub.iterdir():
                if entry.name.startswith(".") or not is_hex(entry.name) or entry.name[:2] != sub.name:
                    entry.unlink(missing_ok=True)  # a write cut short, or nothing of ours
                    continue
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
        with self._lock:
            self._sizes.clear()
            for _mtime, digest, size in sorted(found):
                self._sizes[digest] = size
            self._used = sum(self._sizes.values())
        event(log, "cache.recovered", chunks=len(found), bytes=self._used, root=str(self.root))
        return len(found)

    def get(self, digest: str) -> int | None:
        """The size of chunk ``digest`` if held (marking it recently used), else ``None``."""
        with self._lock:
            size = self._sizes.get(digest)
            if size is not None:
                self._sizes.move_to_end(digest)
            return size

    def holds(self, digest: str) -> bool:
        """Whether chunk ``digest`` is held (without marking it used)."""
        return digest in self._sizes

    @property
    def used(self) -> int:
        """Bytes held."""
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, digest: str, data: bytes | memoryview, pinned: frozenset[str] | set[str]) -> None:
        """Store verified chunk ``digest`` durably, evicting unpinned LRU chunks to stay within capacity."""
        self._make_room(len(data), pinned | {digest})
        target = self.path(digest)
        target.parent.mkdir(exist_ok=True)
        atomic_write(target, data, mode=0o444)
        with self._lock:
            if digest not in self._sizes:
                self._used += len(data)
            self._sizes[digest] = len(data)
            self._sizes.move_to_end(digest)

    def _make_room(self, need: int, pinned: frozenset[str] | set[str]) -> None:
        if self.capacity <= 0:
            return
        victims: list[str] = []
        with self._lock:
            free = self.capacity - self._used
            for digest, size in self._sizes.items():
                if free >= need:
                    break
                if digest not in pinned:
                    victims.append(digest)
                    free += size
            for digest in victims:
                self._used -= self._sizes.pop(digest)
        for digest in victims:
            self.path(digest).unlink(missing_ok=True)
        self.evicted += len(victims)
        if victims:
            event(log, "cache.evicted", chunks=len(victims), used=self._used, capacity=self.capacity)
        if free < need:
            event(log, "cache.over_capacity", logging.WARNING, used=self._used, need=need, capacity=self.capacity)
