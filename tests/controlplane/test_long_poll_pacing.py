"""The long-poll fleet is paced: expiries spread over the whole window, a change still wakes every
parked poll (a batch at a time, in about a second for 5,000), and the woken polls are asked back spread out."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import pytest

from controlplane import pacing
from controlplane.pacing import Waker, expiry
from tests.controlplane.fleet_parts import (
    BackgroundPoll,
    Headers,
    desired,
    register,
    set_pointer,
    wait_until,
    waiting_polls,
)

pytestmark = pytest.mark.timeout(60)

WAIT = 30.0


def test_polls_parked_together_expire_spread_over_the_whole_window() -> None:
    now = 1_796_000_000.0
    waits = [expiry(f"node-{i}", now, WAIT) for i in range(5000)]
    assert all(0 < w <= WAIT for w in waits)
    per_tenth = [sum(1 for w in waits if k * WAIT / 10 <= w < (k + 1) * WAIT / 10) for k in range(10)]
    # Uniform but for the phases within a second of ``now``, which move to the window's last second.
    assert all(300 <= n <= 800 for n in per_tenth), per_tenth


@pytest.mark.parametrize("late", [0.0005, 0.2, 3.0])
def test_a_node_polls_once_per_window_in_the_steady_state(late: float) -> None:
    # A poll answered on its phase comes back ``late`` s later: it waits out the rest of the window,
    # never a sliver (a timer firing a moment early must not make it ask twice).
    first = 1_796_000_000.0
    ends = first + expiry("gpu-7", first, WAIT)
    again = expiry("gpu-7", ends + late, WAIT)
    assert WAIT - late - 1.0 <= again <= WAIT


def test_a_change_wakes_every_poll_a_batch_per_loop_turn_and_asks_them_back_spread() -> None:
    async def scenario() -> tuple[list[int], list[float]]:
        loop = asyncio.get_running_loop()
        waker = Waker(batch=64, rng=random.Random(3))
        futures = [loop.create_future() for _ in range(5000)]
        waker.wake(futures)
        resolved = []
        while waker.pending():
            await asyncio.sleep(0)  # ok-sleep: one event-loop turn, the unit the waker paces by
            resolved.append(sum(f.done() for f in futures))
        assert all(f.done() for f in futures)
        return resolved, [waker.poll_after() for _ in range(5000)]

    resolved, delays = asyncio.run(scenario())
    assert resolved[0] <= 64 * 2, "a change resolved far more than a batch in one loop turn"
    spread = 5000 / pacing.REPOLL_RATE
    assert all(0 <= d < spread for d in delays)
    assert sum(d < spread / 2 for d in delays) in range(2000, 3001), "delays not spread over the whole spread"


def test_a_pointer_change_still_wakes_every_parked_poll_and_spreads_their_return(
    monkeypatch: pytest.MonkeyPatch,
    live_controlplane: Any,
    cp_client: httpx.Client,
    agent: Headers,
    operator: Headers,
    chat: dict[str, str],
) -> None:
    monkeypatch.setattr(pacing, "REPOLL_RATE", 10.0)  # 30 polls come back over 3 s
    nodes = [register(cp_client, agent, f"gpu-{i}", "chat") for i in range(30)]
    polls = [BackgroundPoll(live_controlplane.url, agent, n, desired(cp_client, agent, n)["revision"], WAIT) for n in nodes]
    wait_until(lambda: waiting_polls(live_controlplane.state) == len(nodes), 10, "every long-poll parking")

    set_pointer(cp_client, operator, stable="v2")
    changed = time.monotonic()

    answers = [poll.join(timeout=10) for poll in polls]
    assert max(poll.arrived for poll in polls) - changed < 2.0
    assert all(a.json()["deployments"][0]["digest"] == chat["v2"] for a in answers)
    delays = [float(a.headers.get("Poll-After", 0)) for a in answers]
    assert all(0 <= d < 3.0 for d in delays)
    assert len(set(delays)) > len(nodes) // 2, f"woken polls are not asked back spread out: {delays}"
