"""What each deployment serves on this node, as model servers see it, and waiting for switches.

The view is derived, never stored twice: the epoch book says which digest and epoch a
deployment serves, the store says whether that digest is ready and where it lives. Every switch
calls ``changed()``, which wakes the local API's long-polls.
"""

from __future__ import annotations

import asyncio
import contextlib

from agent.epochs import EpochBook
from agent.store import VersionStore
from weightship.schemas import LocalDeployment

__all__ = ["Serving"]


class Serving:
    """The per-deployment serving view and a condition to wait on."""

    def __init__(self, store: VersionStore, book: EpochBook) -> None:
        self.store = store
        self.book = book
        self._changed = asyncio.Condition()
        self._waiting = 0

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
        async with self._changed:
            self._changed.notify_all()

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
