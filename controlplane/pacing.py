"""Pacing the parked long-polls: when they expire, how fast a change wakes them, when they come back.

A pointer change answers every parked poll on its deployment at once, and every agent asks again
right away. Left alone that is a wave: thousands of answers and re-polls within a second, and
again at every expiry after it, since polls that parked together would expire together.
Heartbeats queue behind it. Three things flatten it:

- **Expiry on a per-node phase** (``expiry``). A poll allowed ``wait`` seconds ends at the next
  instant where the wall clock modulo ``wait`` equals the node's phase, a hash of its id spread
  uniformly over ``[0, wait)``. However the polls parked, their expiries are spread evenly over
  the window (a fleet that re-parked together expires one node after another), and in the steady
  state each node asks exactly once per ``wait``, no more often than without pacing. Every
  replica computes the same phase, so a node whose polls move between replicas keeps it. A phase
  less than ``_MIN_AHEAD`` away is taken from one window later, less ``_MIN_AHEAD``, so a poll
  that comes back a moment before its own phase is not answered straight away.
- **Paced wakes** (``Waker``). A change resolves its parked polls ``WAKE_BATCH`` at a time, with
  a short pause between batches, so requests already waiting (heartbeats) are served in between
  rather than after all of them. 5,000 polls are answered in about a second.
- **A spread return** (``Waker.poll_after``). The answer to a poll woken by a change carries a
  ``Poll-After`` header: the agent asks again after that many seconds, drawn uniformly from
  ``[0, woken / REPOLL_RATE)`` (at most ``MAX_SPREAD_SECONDS``), so the fleet comes back at
  ``REPOLL_RATE`` polls a second, not all at once. The price: a second change made within that
  spread reaches a node that is still waiting to ask only once it asks (at most the spread later).
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections import deque
from collections.abc import Iterable

__all__ = ["MAX_SPREAD_SECONDS", "REPOLL_RATE", "WAKE_BATCH", "Waker", "expiry"]

#: parked polls resolved per batch when a change wakes them
WAKE_BATCH = 32
#: pause between two batches, so requests already waiting are served in between
WAKE_GAP_SECONDS = 0.006
#: polls per second that a woken fleet is asked to come back at
REPOLL_RATE = 1000.0
#: the longest a woken poll is asked to wait before it comes back
MAX_SPREAD_SECONDS = 10.0
#: a delay below this is not worth a header
_MIN_DELAY = 0.01
#: a phase nearer than this (or this share of the wait, if less) counts from the next window
_MIN_AHEAD = 1.0
_MIN_AHEAD_SHARE = 0.05


def expiry(node_id: str, now: float, wait: float) -> float:
    """Seconds a poll of node ``node_id`` parked at wall-clock ``now`` waits, at most ``wait``: to its next phase."""
    if wait <= 0:
        return 0.0
    phase = zlib.crc32(node_id.encode()) / 2**32 * wait
    ahead = (phase - now) % wait
    margin = min(_MIN_AHEAD, _MIN_AHEAD_SHARE * wait)
    return ahead if ahead >= margin else wait - margin + ahead


class Waker:
    """Resolves the futures of woken polls in paced batches, and says when those polls should come back."""

    def __init__(self, batch: int = WAKE_BATCH, rng: random.Random | None = None) -> None:
        self._batch = batch
        self._rng = rng or random.Random()
        self._queue: deque[asyncio.Future[None]] = deque()
        self._task: asyncio.Task[None] | None = None
        #: loop time and size of the latest wake, and the spread its polls come back over
        self._woken_at = float("-inf")
        self._spread = 0.0

    def wake(self, futures: Iterable[asyncio.Future[None]]) -> None:
        """Resolve ``futures`` soon, ``batch`` per event-loop turn, in order."""
        before = len(self._queue)
        self._queue.extend(futures)
        count = len(self._queue) - before
        if not count:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        # Waves that overlap add up: their polls come back over one spread.
        waiting = self._spread - (now - self._woken_at) if now - self._woken_at < self._spread else 0.0
        self._spread = min(MAX_SPREAD_SECONDS, max(0.0, waiting) + count / REPOLL_RATE)
        self._woken_at = now
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="long-poll-waker")

    def poll_after(self) -> float:
        """Seconds a poll answered now with news should wait before asking again (0: at once)."""
        left = self._spread - (asyncio.get_running_loop().time() - self._woken_at)
        if left <= 0:
            return 0.0
        delay = self._rng.uniform(0, self._spread)
        return delay if delay >= _MIN_DELAY else 0.0

    def pending(self) -> int:
        """Futures not resolved yet."""
        return len(self._queue)

    async def _run(self) -> None:
        queue = self._queue
        while queue:
            for _ in range(min(self._batch, len(queue))):
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)
            if queue:
                await asyncio.sleep(WAKE_GAP_SECONDS)  # let what is already waiting run before the next batch
