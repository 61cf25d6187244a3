"""The one change watcher each control-plane process runs for its lifetime.

It starts the change feed (``controlplane.notify``: a ``LISTEN`` connection on PostgreSQL,
in-process delivery on SQLite), subscribes the auth cache and the desired-state snapshots to it
before the first notification can arrive, and runs the snapshots' periodic recheck.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from controlplane.authcache import token_cache_of
from controlplane.notify import changes_of
from controlplane.snapshot import snapshots_of

__all__ = ["watching"]


@contextlib.asynccontextmanager
async def watching(state: Any) -> AsyncIterator[None]:
    """Watch for changes made by any process while the body runs (the app's lifespan)."""
    feed = changes_of(state)
    token_cache_of(state)
    snapshots = snapshots_of(state)
    await feed.start()
    recheck = asyncio.create_task(snapshots.recheck_forever(), name="snapshot-recheck")
    try:
        yield
    finally:
        recheck.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recheck
        await feed.stop()
