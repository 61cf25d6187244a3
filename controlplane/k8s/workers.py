"""One worker per ModelRollout: it reconciles every ``interval`` seconds, and at once when the object changes.

Why not kopf's timers: kopf puts its finalizer on every object a timer (or a daemon) runs for, so
that it can stop the timer before the object goes. Then deleting a ModelRollout, its namespace,
or the whole release with the operator already gone hangs until someone strips the finalizer by
hand. The operator has nothing to clean up at deletion (its ReplicaSets are owned by the
ModelRollout, so the garbage collector removes them), so nothing here blocks a deletion: kopf only
reports what its watch sees (``on.event`` handlers, which add no finalizer, and make kopf remove
one that an earlier operator version added), and these workers keep the time.

A worker is woken early when the object's ``generation`` (its spec, a ``kubectl scale``) or its
annotations (a verb) change. Other changes, its own status writes first of all, wait for the
next tick, so writing the status does not make it spin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Workers"]

Key = tuple[str, str]


@dataclass
class _Worker:
    task: asyncio.Task[None]
    wake: asyncio.Event
    trigger: str = ""


@dataclass
class Workers:
    """The running workers, keyed by (namespace, name); ``reconcile(namespace, name)`` does one pass."""

    reconcile: Callable[[str, str], Awaitable[None]]
    interval: float
    _running: dict[Key, _Worker] = field(default_factory=dict)

    def seen(self, namespace: str, name: str, body: Mapping[str, Any], *, gone: bool) -> None:
        """What the watch reported: start, wake or stop the object's worker."""
        key = (namespace, name)
        meta = body.get("metadata") or {}
        if gone or meta.get("deletionTimestamp"):
            self.stop(key)
            return
        trigger = json.dumps([meta.get("generation"), meta.get("annotations") or {}], sort_keys=True, default=str)
        worker = self._running.get(key)
        if worker is None or worker.task.done():
            wake = asyncio.Event()
            task = asyncio.create_task(self._loop(namespace, name, wake), name=f"modelrollout {namespace}/{name}")
            self._running[key] = _Worker(task, wake, trigger)
        elif worker.trigger != trigger:
            worker.trigger = trigger
            worker.wake.set()

    def stop(self, key: Key) -> None:
        """Stop the worker of a deleted object (a reconcile in flight is cancelled)."""
        worker = self._running.pop(key, None)
        if worker is not None:
            worker.task.cancel()

    async def stop_all(self) -> None:
        """Stop every worker and wait until they are gone."""
        workers = list(self._running.values())
        self._running.clear()
        for worker in workers:
            worker.task.cancel()
        for worker in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker.task

    @property
    def keys(self) -> set[Key]:
        """The objects that have a worker now."""
        return set(self._running)

    async def _loop(self, namespace: str, name: str, wake: asyncio.Event) -> None:
        while True:
            wake.clear()
            await self.reconcile(namespace, name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.interval)
