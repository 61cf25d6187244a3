"""The HTTP server process: uvicorn's, which on SIGTERM or SIGINT also answers parked long-polls.

uvicorn lets open requests finish before it exits. A desired-state long-poll would hold the stop
up for the rest of its wait (up to ``WEIGHTSHIP_LONG_POLL_MAX``, 30 s by default) and keep its
agent on a replica that is going away; answered at once, the agent asks again and reaches another
replica (or, with none, backs off until this one is back).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import uvicorn
from fastapi import FastAPI

__all__ = ["DrainingServer"]


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` for ``app`` (``controlplane.app.create_app``) that drains parked polls on exit."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        state = getattr(self.app.state, "ws", None)  # set by the app's lifespan once it started
        if state is not None:
            # A signal handler runs between two steps of the event loop's own thread: hand the work
            # to the loop (thread-safe, so a loop asleep in select() wakes for it).
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon_threadsafe(state.snapshots.drain)
        ui = getattr(self.app.state, "ui", None)  # the status page's parts, made on its first visit
        if ui is not None:
            # open /ui/ event streams end too (the browser reconnects to another replica)
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon_threadsafe(ui.hub.drain)
