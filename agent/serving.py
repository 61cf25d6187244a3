"""What each deployment serves on this node, as model servers see it, and waiting for switches.

The view is derived, never stored twice: the epoch book says which digest and epoch a
deployment serves, the store says whether that digest is ready and where it lives. Every switch
calls ``changed()``, which wakes the local API's long-polls; a fetch that ends calls ``poke()``,
which wakes the long-polls on versions asked for by digest (``settle``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

from agent.epochs import EpochBook
from agent.store import VersionStore
from weightship.schemas import LocalDeployment

__all__ = ["Serving"]

_T = TypeVar("_T")


class Serving:
    """The per-deployment serving view and a condition to wait on."""

    def __init__(self, store: VersionStore, book: EpochBook) -> None:
        self.store = store
        self.book = book
        self._changed = asyncio.Condition()
        self._waiting = 0
        self._poked = asyncio.Event()

    def get(self, name: str) -> LocalDeployment | None:
        """What ``name`` serves here, or ``None`` if this node never had a pointer for it."""
        record = self.book.get(name)
        if record is None:
            return None
        ready = record.digest is not None and self.store.is_ready(record.digest)
        return LocalDeployment(
            name=name,
            model=record.model,
            digest=record.digest,
            path=str(self.store.path(record.digest)) if ready and record.digest else None,
            epoch=record.applied_epoch,
            ready=ready,
        )

    @property
    def waiting(self) -> int:
        """How many ``wait`` calls are parked right now (what a long-poll test waits for)."""
        return self._waiting

    async def changed(self) -> None:
        """Wake everyone waiting for a switch."""
        self.poke()
        async with self._changed:
            self._changed.notify_all()

    def poke(self) -> None:
        """Wake everyone in ``settle`` to look again (from code on the event loop that cannot await)."""
        poked, self._poked = self._poked, asyncio.Event()
        poked.set()

    async def settle(self, check: Callable[[], _T | None], within: float) -> _T | None:
        """``check()`` once it is not ``None``, looking again at every ``poke``; ``None`` if ``within`` seconds pass first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        self._waiting += 1
        try:
            while True:
                poked = self._poked  # taken before checking: a poke in between is not lost
                found = check()
                remaining = deadline - loop.time()
                if found is not None or remaining <= 0:
                    return found
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(poked.wait(), remaining)
        finally:
            self._waiting -= 1

    async def wait(self, name: str, after_epoch: int, within: float) -> LocalDeployment | None:
        """``name``'s view once it is ready at an epoch above ``after_epoch``; ``None`` if ``within`` seconds pass first."""

        def settled() -> LocalDeployment | None:
            view = self.get(name)
            return view if view is not None and view.ready and view.epoch > after_epoch else None

        async with self._changed:
            self._waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(lambda: settled() is not None), within)
            finally:
                self._waiting -= 1
        return settled()
