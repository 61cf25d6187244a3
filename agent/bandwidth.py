"""Bandwidth caps: a token bucket that paces bytes sent or received to a configured rate.

A peer or cache that uploads as fast as its disk allows starves the GPU node's own downloads
and the model server's traffic; an upstream fetcher that takes the whole link starves the nodes
it serves. Both pace themselves with a ``TokenBucket``: ``take(n)`` waits until ``n`` bytes of
budget have accrued. Rate 0 means unlimited (``take`` returns at once). The bucket holds at most
``burst`` bytes (default: a quarter second of rate, at least 64 KiB), so an idle period does not
turn into a long burst above the cap. Callers take in slices (``SLICE``) so one big chunk does
not wait for its whole budget up front and then go out at line rate.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["SLICE", "TokenBucket"]

#: bytes paced at a time
SLICE = 1024 * 1024


class TokenBucket:
    """Paces bytes to ``rate`` bytes per second (0: unlimited); shared by every transfer it caps."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = max(0.0, float(rate))
        self.burst = burst if burst is not None else max(self.rate / 4, 64.0 * 1024)
        self._tokens = self.burst
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()  # first come, first served: no transfer starves

    @property
    def unlimited(self) -> bool:
        """Whether the bucket never waits."""
        return self.rate <= 0

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes may go (at most ``burst`` are taken at once; larger ``n`` waits longer)."""
        if self.unlimited or n <= 0:
            return
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            if self._tokens < 0:
                # Debt: sleep until it is repaid; holding the lock keeps later takers behind us.
                await asyncio.sleep(-self._tokens / self.rate)
                self._stamp = time.monotonic()
                self._tokens = 0.0
