"""Retention: what stays on disk within the quota, what is evicted, and when the disk is full.

Every version a deployment references (stable, previous stable, canary: the ``keep`` list of
the desired state), every version a deployment serves or the agent is fetching, and every version
a model server on this node holds (``agent.pins``: a pinned server's lease, or a recent ask for it
by digest) is *protected* and never deleted: a pod of the previous version, kept for a rollback
window, keeps its weights on disk after the pointer has moved on twice. Everything else is the LRU tail: kept while it fits, evicted
least-recently-referenced first when room is needed, with abandoned partial staging areas going
before any complete version.

Room is needed in two cases: a fetch that will write ``need`` more bytes, and a quota lowered
below the current usage (``trim``). Usage is measured on disk (allocated blocks, each hard-linked
inode once) after every eviction rather than predicted, so shared files are never miscounted.
Bytes other in-flight fetches will still write are reserved so two fetches cannot both claim
the same free space. When evicting everything unprotected is not enough, ``DiskFullError`` says
how much is needed, what holds the space and what to do; nothing partial is ever marked ready.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.store import VersionStore
from weightship.errors import DiskFullError
from weightship.logs import event
from weightship.sizes import format_size

__all__ = ["Candidate", "Retention", "choose_eviction"]

log = logging.getLogger("agent.retention")


@dataclass(frozen=True, slots=True)
class Candidate:
    """Something that could be evicted: a ready version or an abandoned staging area."""

    digest: str
    partial: bool
    last_used: float


def choose_eviction(candidates: Iterable[Candidate], protected: set[str]) -> Candidate | None:
    """The next thing to evict: unprotected partial staging areas first, then the least recently used version."""
    eligible = [c for c in candidates if c.digest not in protected]
    if not eligible:
        return None
    return min(eligible, key=lambda c: (not c.partial, c.last_used, c.digest))


class Retention:
    """Keeps the store within its quota and the disk's free space; thread-safe."""

    def __init__(
        self,
        store: VersionStore,
        quota_bytes: int,
        min_free_bytes: int,
        on_evicted: Callable[[str], None] = lambda _digest: None,
    ) -> None:
        self.store = store
        #: called with each evicted digest, in the evicting (worker) thread
        self.on_evicted = on_evicted
        self.quota_bytes = quota_bytes
        self.min_free_bytes = min_free_bytes
        self._reserved: dict[str, int] = {}
        # ``_lock`` guards the reservations and is taken on the event loop (progress, release),
        # so it is never held across disk work. ``_evicting`` makes room-making decisions one at a
        # time (two fetches cannot claim the same free space); only worker threads take it.
        self._lock = threading.Lock()
        self._evicting = threading.Lock()

    def reserved(self) -> int:
        """Bytes in-flight fetches will still write."""
        with self._lock:
            return sum(self._reserved.values())

    def make_room(self, digest: str, need: int, protected: set[str]) -> list[str]:
        """Reserve ``need`` bytes for fetching ``digest``, evicting as needed; returns what was evicted.

        ``protected`` (a snapshot taken by the caller: served, kept and in-flight digests) is never
        evicted. Raises ``DiskFullError`` if evicting everything else still leaves too little room.
        """
        evicted: list[str] = []
        with self._evicting:
            self.release(digest)
            while True:
                others = self.reserved()
                excess = self._excess(need + others)
                if excess <= 0:
                    with self._lock:
                        self._reserved[digest] = need
                    if evicted:
                        event(log, "retention.made_room", digest=digest, need=need, evicted=",".join(evicted))
                    return evicted
                victim = choose_eviction(self._candidates(), protected | {digest})
                if victim is None:
                    raise self._full(digest, need, others, excess, protected)
                self._evict(victim)
                evicted.append(victim.digest)

    def progress(self, digest: str, written: int) -> None:
        """``written`` more bytes of ``digest`` are now on disk (they count as usage, not reservation)."""
        with self._lock:
            if digest in self._reserved:
                self._reserved[digest] = max(0, self._reserved[digest] - written)

    def release(self, digest: str) -> None:
        """The fetch of ``digest`` ended; drop what is left of its reservation."""
        with self._lock:
            self._reserved.pop(digest, None)

    def trim(self, protected: set[str]) -> list[str]:
        """Evict LRU versions while the store is over its quota (e.g. after the quota was lowered)."""
        evicted: list[str] = []
        if not self.quota_bytes:
            return evicted
        with self._evicting:
            while self.store.usage_bytes() > self.quota_bytes:
                victim = choose_eviction((c for c in self._candidates() if not c.partial), protected)
                if victim is None:
                    break
                self._evict(victim)
                evicted.append(victim.digest)
        return evicted

    def _excess(self, need: int) -> int:
        """Bytes that must be freed before ``need`` more fit (≤ 0: they fit)."""
        _total, free = self.store.disk_free()
        over_disk = need + self.min_free_bytes - free
        if not self.quota_bytes:
            return over_disk
        return max(over_disk, self.store.usage_bytes() + need - self.quota_bytes)

    def _candidates(self) -> list[Candidate]:
        ready = [Candidate(d, False, self.store.last_used(d)) for d in self.store.ready()]
        partial = [Candidate(d, True, mtime) for d, mtime in self.store.staged().items() if not self.store.is_ready(d)]
        return ready + partial

    def _evict(self, victim: Candidate) -> None:
        if victim.partial:
            self.store.remove_staging(victim.digest)
        else:
            self.store.remove(victim.digest)
        self.on_evicted(victim.digest)
        event(
            log, "retention.evicted", digest=victim.digest, partial=victim.partial, last_used=f"{victim.last_used:.0f}"
        )

    def _full(self, digest: str, need: int, others: int, excess: int, protected: set[str]) -> DiskFullError:
        usage = self.store.usage_bytes()
        _total, free = self.store.disk_free()
        held = sorted(d for d in protected if self.store.is_ready(d))
        limit = f"quota {format_size(self.quota_bytes)}" if self.quota_bytes else "no quota"
        return DiskFullError(
            f"no room to fetch {digest}: it needs {format_size(need)} more (plus {format_size(others)} reserved by other "
            f"fetches), {format_size(excess)} short; {limit}, {format_size(usage)} in use, {format_size(free)} free on disk; "
            f"the versions in use are all still referenced by a pointer or held by a model server on this node "
            f"({', '.join(d[:19] + '…' for d in held) or 'none'}), so nothing more can be evicted. Raise the quota (--quota), free disk space, or unreference versions; "
            "see docs/runbooks/disk-full.md. Nothing partial was marked ready."
        )
