"""DelaySequence grows exponentially with jitter, is capped, and resets after a success."""

from __future__ import annotations

import random

from weightship.backoff import DelaySequence


def test_backoff_grows_is_capped_and_resets() -> None:
    backoff = DelaySequence(initial=0.1, maximum=2.0, jitter=0.2, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(8)]
    for n, delay in enumerate(delays):
        base = min(2.0, 0.1 * 2**n)
        assert base * 0.8 <= delay <= min(2.0, base * 1.2)
    assert max(delays) <= 2.0
    backoff.reset()
    assert backoff.next_delay() <= 0.12


def test_jitter_spreads_a_fleet_reconnecting_at_once() -> None:
    firsts = {round(DelaySequence(1.0, 10.0, rng=random.Random(seed)).next_delay(), 3) for seed in range(50)}
    assert len(firsts) > 40
