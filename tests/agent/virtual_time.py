"""A fake clock for asyncio: an event loop whose time only moves when nothing else can happen.

``run_virtual(main)`` runs ``main()`` on a ``VirtualTimeLoop``. Its ``time()`` starts at 0 and
jumps straight to the next timer whenever the loop would otherwise sleep, so a five-minute
backoff or a 300-second long-poll expiry runs in milliseconds, and a test asserts on *loop* time
(``asyncio.get_running_loop().time()``), exactly, never on the wall clock. Work handed to a
thread pool (``run_in_executor``) takes no virtual time: while any is in flight the clock stands
still and the loop waits for it for real, so a disk write never makes a timeout fire early.

Code under test must read time from its loop (``loop.time()``, ``call_at``, ``asyncio.sleep``,
``asyncio.wait_for``), not from ``time.monotonic()``: that is the agent's injectable clock.
Real sockets do not mix with it (a peer's answer takes real time the clock would skip).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple

__all__ = ["VirtualTimeLoop", "run_virtual"]

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class _Selector(selectors.DefaultSelector):
    """Polls without blocking; when nothing is ready, moves the loop's clock to the next timer."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None or self._loop.busy:
            # No timer pending, or a worker thread is still running: only real events can come.
            return super().select(None if timeout is None else 0.05)
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on virtual time (see the module docstring)."""

    def __init__(self) -> None:
        self._now = 0.0
        self._in_flight = 0
        super().__init__(selector=_Selector(self))

    def time(self) -> float:
        """The virtual time, in seconds since the loop was made."""
        return self._now

    @property
    def busy(self) -> bool:
        """Whether work handed to a thread pool is still running."""
        return self._in_flight > 0

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self._now += seconds

    def run_in_executor(self, executor: Executor | None, func: Callable[[*_Ts], _T], *args: *_Ts) -> asyncio.Future[_T]:
        """As asyncio's, with the clock held still until the work is done."""
        future = super().run_in_executor(executor, func, *args)
        self._in_flight += 1
        future.add_done_callback(self._work_done)
        return future

    def _work_done(self, _future: asyncio.Future[Any]) -> None:
        self._in_flight -= 1


def run_virtual(main: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run ``main()`` to completion on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())
