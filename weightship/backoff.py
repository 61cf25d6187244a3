"""The one retry engine: capped exponential backoff with jitter, driven by the error's kind.

``TemporaryError`` means "retry later"; ``PermanentError`` (and any other error) is final and
stops the retries at once. A ``TemporaryError`` may carry the server's hint (``Retry-After``) as
``delay``; the wait is the larger of that hint and the exponential step, never more than ``cap``.
``Backoff.run`` drives a synchronous call, ``Backoff.run_async`` a coroutine; both sleeps are
injectable so tests never wait.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from weightship.errors import TemporaryError, WeightshipError

__all__ = ["Backoff", "DelaySequence", "capped_exponential", "is_temporary"]

_R = TypeVar("_R")
#: hears each failed attempt that will be retried: (attempt, seconds until the next, the error)
OnRetry = Callable[[int, float, WeightshipError], None]


def capped_exponential(attempt: int, base: float, cap: float) -> float:
    """``base * 2**(attempt - 1)`` for a 1-based ``attempt``, never more than ``cap``."""
    return min(cap, base * 2.0 ** (attempt - 1))


def is_temporary(error: WeightshipError) -> bool:
    """Whether retrying ``error`` later may succeed."""
    return isinstance(error, TemporaryError)


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter; ``sleep`` is injectable so tests never wait."""

    attempts: int = 5
    base: float = 0.25
    cap: float = 8.0
    sleep: Callable[[float], None] = time.sleep
    async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    #: each wait is the exponential step times a random factor in ``[jitter_floor, 1]`` (0: full jitter)
    jitter_floor: float = 0.5

    def delay(self, attempt: int, error: WeightshipError) -> float:
        """Seconds to wait before retry ``attempt`` (1-based) after ``error``."""
        exponential = capped_exponential(attempt, self.base, self.cap)
        hinted = error.delay if isinstance(error, TemporaryError) else 0.0
        return max(min(hinted, self.cap), exponential * random.uniform(self.jitter_floor, 1.0))

    def run(
        self,
        call: Callable[[], _R],
        retryable: Callable[[WeightshipError], bool] = is_temporary,
        on_retry: OnRetry | None = None,
    ) -> _R:
        """``call()``, retried while it raises a ``retryable`` error and attempts remain.

        ``on_retry(attempt, delay, error)`` hears each failed attempt that will be retried (to log it).
        """
        attempt = 1
        while True:
            try:
                return call()
            except WeightshipError as exc:
                if attempt >= self.attempts or not retryable(exc):
                    raise
                pause = self.delay(attempt, exc)
                if on_retry is not None:
                    on_retry(attempt, pause, exc)
                self.sleep(pause)
                attempt += 1

    async def run_async(
        self,
        call: Callable[[], Awaitable[_R]],
        retryable: Callable[[WeightshipError], bool] = is_temporary,
        on_retry: OnRetry | None = None,
    ) -> _R:
        """``await call()``, retried like ``run`` but sleeping with ``async_sleep``."""
        attempt = 1
        while True:
            try:
                return await call()
            except WeightshipError as exc:
                if attempt >= self.attempts or not retryable(exc):
                    raise
                pause = self.delay(attempt, exc)
                if on_retry is not None:
                    on_retry(attempt, pause, exc)
                await self.async_sleep(pause)
                attempt += 1


@dataclass
class DelaySequence:
    """Stateful backoff for long-running loops (reconnects, chunk retries): each call waits longer.

    Delays are ``initial * 2**n`` capped at ``maximum``, each scaled by ``1 ± jitter`` so a
    fleet reconnecting after an outage does not arrive in the same instant. ``rng`` is injectable
    so tests can check the sequence without sleeping.
    """

    initial: float
    maximum: float
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0

    def next_delay(self) -> float:
        """The delay before the next try; grows with every call until ``reset``."""
        self.attempts += 1
        base = capped_exponential(self.attempts, self.initial, self.maximum)
        spread = base * self.jitter
        return min(self.maximum, max(0.0, base + self.rng.uniform(-spread, spread)))

    def reset(self) -> None:
        """Start again from ``initial`` (after a success)."""
        self.attempts = 0
