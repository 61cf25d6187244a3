"""Byte and chunk counters of one agent run; what the heartbeat reports and the demo prints."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from agent.sources import SourceCounters
from weightship.schemas import NodeCounters

__all__ = ["Counters"]


@dataclass
class Counters:
    """Monotonic counters since the agent started; safe to bump from worker threads."""

    bytes_downloaded: int = 0
    bytes_from_peers: int = 0
    bytes_copied_locally: int = 0
    chunks_rejected: int = 0
    sources: SourceCounters = field(default_factory=SourceCounters, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> NodeCounters:
        """The counters as the heartbeat schema."""
        with self._lock:
            return NodeCounters(
                bytes_downloaded=self.bytes_downloaded,
                bytes_from_peers=self.bytes_from_peers,
                bytes_copied_locally=self.bytes_copied_locally,
                chunks_rejected=self.chunks_rejected,
                sources=self.sources.snapshot(),
            )
