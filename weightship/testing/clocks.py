"""Clocks a test moves by hand, so timeouts, leases and backoff run without waiting.

``ManualClock`` stands in for ``time.monotonic`` / ``time.time`` (and, through ``sleep``, for
``time.sleep``: a sleep moves the clock and is recorded); ``ManualUTCClock`` stands in for a
``datetime.now(UTC)`` source.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ["ManualClock", "ManualUTCClock"]


class ManualClock:
    """Seconds that move only when the test says so: call it for the time, ``advance`` or ``sleep`` to move it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        #: every ``sleep`` asked for, in order
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``."""
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A ``time.sleep`` that returns at once: it records ``seconds`` and moves the clock by them."""
        self.sleeps.append(seconds)
        self.now += seconds


class ManualUTCClock:
    """A timezone-aware ``now`` that moves only when the test says so."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``."""
        self.now += timedelta(seconds=seconds)
