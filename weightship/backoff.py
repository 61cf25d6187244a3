"""Retrying temporary failures: capped exponential backoff with jitter.

``TemporaryError`` means "retry later"; everything else is final. A ``TemporaryError`` may carry
the server's hint (``Retry-After``) as ``delay``; the wait is the larger of that hint and the
exponential step, never more than ``cap``. ``sleep`` is injectable so tests never wait.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from weightship.errors import TemporaryError, WeightshipError

__all__ = ["Backoff", "is_temporary"]

_R = TypeVar("_R")


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

    def delay(self, attempt: int, error: WeightshipError) -> float:
        """Seconds to wait before retry ``attempt`` (1-based) after ``error``."""
        exponential = min(self.cap, self.base * 2.0 ** (attempt - 1))
        hinted = error.delay if isinstance(error, TemporaryError) else 0.0
        return max(min(hinted, self.cap), exponential * random.uniform(0.5, 1.0))

    def run(self, call: Callable[[], _R], retryable: Callable[[WeightshipError], bool]) -> _R:
        """``call()``, retried while it raises a ``retryable`` error and attempts remain."""
        attempt = 1
        while True:
            try:
                return call()
            except WeightshipError as exc:
                if attempt >= self.attempts or not retryable(exc):
                    raise
                self.sleep(self.delay(attempt, exc))
                attempt += 1
