"""Capped exponential backoff with jitter, for reconnecting to the control plane and retries.

Jitter spreads a fleet's reconnects after a control-plane outage so thousands of agents do not
arrive in the same instant. The random source is injectable so tests can check the sequence
without sleeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass
class Backoff:
    """Delays ``initial * factor**n``, capped at ``maximum``, each scaled by ``1 ± jitter``."""

    initial: float
    maximum: float
    factor: float = 2.0
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0

    def next_delay(self) -> float:
        """The delay before the next try; grows with every call until ``reset``."""
        base = min(self.maximum, self.initial * self.factor**self.attempts)
        self.attempts += 1
        spread = base * self.jitter
        return min(self.maximum, max(0.0, base + self.rng.uniform(-spread, spread)))

    def reset(self) -> None:
        """Start again from ``initial`` (after a success)."""
        self.attempts = 0
