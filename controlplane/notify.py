"""Change notification between control-plane processes: one watcher per process, no polling.

Whatever a parked request waits for (a serving pointer moving, a token being revoked) is
*announced* by the process that committed it, after the commit, as a short topic string:

- ``deployments``: some serving pointer changed; every process re-reads the deployments its
  parked long-polls watch (one query per process, however many polls are parked).
- ``staging``: a preheat or a warm pool changed (``controlplane.staging``); every process re-reads
  its staging view and wakes the polls of the nodes whose ``stage`` moved.
- ``token:<id>``: token ``<id>`` was revoked; every process drops it from its auth cache.
- ``resync``: delivered locally only, when the watcher (re)connects: notifications may have been
  missed, so caches are dropped and snapshots re-read.

On PostgreSQL an announcement is ``pg_notify('weightship_changes', '<origin>|<topic>')`` and
every process runs one dedicated ``LISTEN`` connection (psycopg, autocommit) outside the
SQLAlchemy pool; the announcing process delivers to itself at once and ignores its own echo
(``origin`` names the process). On SQLite, which is for one process, announcements are delivered
in-process only. Delivery runs listeners on the event loop; they must not block.

A notification lost while the listening connection was down is covered twice: a reconnect
delivers ``resync``, and the snapshots re-read what parked polls watch every
``controlplane.snapshot.RECHECK_SECONDS`` anyway (and cached tokens likewise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import Engine

from weightship.logs import event

__all__ = ["CHANNEL", "DEPLOYMENTS", "RESYNC", "STAGING", "ChangeFeed", "token_topic"]

log = logging.getLogger(__name__)

#: the PostgreSQL channel every process listens on
CHANNEL = "weightship_changes"
DEPLOYMENTS = "deployments"
RESYNC = "resync"
STAGING = "staging"
_TOKEN_PREFIX = "token:"  # noqa: S105 - a topic prefix, not a secret
#: how long the listener waits for a notification before checking its connection is alive
_LISTEN_CHECK_SECONDS = 30.0
_RECONNECT_SECONDS = (0.1, 0.5, 1.0, 2.0, 5.0)

Listener = Callable[[str], None]


def token_topic(token_id: str) -> str:
    """The topic announcing that token ``token_id`` was revoked."""
    return _TOKEN_PREFIX + token_id


class ChangeFeed:
    """This process's end of the change notifications: announce, and deliver to listeners."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._postgres = engine.dialect.name == "postgresql"
        self._origin = uuid.uuid4().hex[:12]
        self._listeners: list[Listener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(topic)`` on the event loop for every change announced by any process."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Start listening (PostgreSQL); returns once the first ``LISTEN`` is in place or has failed once."""
        self._loop = asyncio.get_running_loop()
        if not self._postgres:
            return
        self._task = asyncio.create_task(self._listen_forever(), name="change-feed")
        # Wait for the first LISTEN so a change committed right after start-up is not missed; a
        # database that is down must not block start-up, so give up waiting after a while.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout=10)

    async def stop(self) -> None:
        """Stop listening."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def announce(self, topic: str) -> None:
        """Announce ``topic`` to every process (this one at once); call after the change is committed."""
        self._deliver(topic)
        if self._postgres:
            await asyncio.to_thread(self._notify, topic)

    def announce_from_thread(self, topic: str) -> None:
        """``announce`` for synchronous code running in a worker thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, topic)
        if self._postgres:
            self._notify(topic)

    def _notify(self, topic: str) -> None:
        try:
            with self._engine.begin() as conn:
                conn.execute(
                    text("SELECT pg_notify(:channel, :payload)"),
                    {"channel": CHANNEL, "payload": f"{self._origin}|{topic}"},
                )
        except Exception as exc:  # why: the change is committed; peers resync within RECHECK_SECONDS
            event(log, "change.announce_failed", logging.WARNING, topic=topic, error=exc)

    def _deliver(self, topic: str) -> None:
        for listener in self._listeners:
            try:
                listener(topic)
            except Exception:  # why: one listener's bug must not starve the others
                event(log, "change.listener_failed", logging.ERROR, topic=topic, exc_info=True)

    def _received(self, payload: str) -> None:
        origin, _, topic = payload.partition("|")
        if origin != self._origin:
            self._deliver(topic)

    async def _listen_forever(self) -> None:
        import psycopg

        conninfo = self._engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        failures = 0
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    if failures:
                        event(log, "change.feed_reconnected", after_failures=failures)
                    failures = 0
                    self._connected.set()
                    # Anything announced while we were not listening is unknown: start afresh.
                    self._deliver(RESYNC)
                    while True:
                        async for notice in conn.notifies(timeout=_LISTEN_CHECK_SECONDS):
                            self._received(notice.payload)
                        await conn.execute("SELECT 1")  # a dead connection raises here, not never
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # why: psycopg and OS errors alike: reconnect
                delay = _RECONNECT_SECONDS[min(failures, len(_RECONNECT_SECONDS) - 1)]
                failures += 1
                event(
                    log,
                    "change.feed_disconnected",
                    logging.WARNING,
                    error=exc,
                    retry_in=f"{delay:.1f}",
                    attempt=failures,
                )
                await asyncio.sleep(delay)
