"""The one change watcher each control-plane process runs for its lifetime.

It starts the change feed (``controlplane.notify``: a ``LISTEN`` connection on PostgreSQL,
in-process delivery on SQLite), subscribes the auth cache and the desired-state snapshots to it
before the first notification can arrive, and runs the periodic recheck that backs up lost
announcements (pointers that parked polls watch, tokens the auth cache holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool

from controlplane import snapshot
from controlplane.state import AppState
from weightship.logs import event

__all__ = ["watching"]

log = logging.getLogger(__name__)


async def _recheck_forever(state: AppState) -> None:
    """The backstop for lost announcements: every ``RECHECK_SECONDS``, at most two small queries."""
    while True:
        await asyncio.sleep(snapshot.RECHECK_SECONDS)  # read each time: tests shorten or lengthen it
        state.snapshots.recheck()
        try:
            await run_in_threadpool(state.tokens.recheck, state.sessions)
        except Exception as exc:  # why: a database hiccup; the next round tries again
            event(log, "token.recheck_failed", logging.WARNING, error=exc)


@contextlib.asynccontextmanager
async def watching(state: AppState) -> AsyncIterator[None]:
    """Watch for changes made by any process while the body runs (the app's lifespan)."""
    feed = state.changes
    await feed.start()
    recheck = asyncio.create_task(_recheck_forever(state), name="change-recheck")
    try:
        yield
    finally:
        recheck.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recheck
        await feed.stop()
