"""Bounds on the peer listener's connections: how many, how long idle, and how much it logs about them.

Anyone who can reach the peer listener can open a connection; a ticket is checked only once a
request arrives. Without bounds, idle connections pile up until the process runs out of file
descriptors, and then the local API, the control-plane client and chunk files fail with it.

- At most ``max_connections`` connections at once, below the process's file-descriptor limit with
  slack kept for everything else the agent opens (``default_max_connections``). The listener
  accepts connections itself (not ``loop.create_server``, whose accept loop takes up to its
  backlog at once and, out of descriptors, logs a traceback per attempt): a few per wake-up, each
  counted before it is handed to aiohttp. A connection arriving at the cap closes the connection
  idle the longest (no request in progress), so a normal request always gets in; when every
  connection is busy the new one is answered 503 and closed. When ``accept`` itself fails (the
  process is out of descriptors anyway) the listener pauses for a second and logs that once per
  interval.
- A connection with no request in progress for ``idle_timeout`` seconds is closed, whether it
  never sent a byte, sent half a request head, or finished its last request.
- Log lines about connections and uploads are rate-limited per cause (``LogBudget``): an attacker
  opening thousands of connections costs a few lines, each saying how many were suppressed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from weightship.logs import event

__all__ = ["ListenerBounds", "LogBudget", "default_max_connections"]

#: most connections a listener accepts however high the fd limit
_MAX_CONNECTIONS_CEILING = 8192
#: causes a ``LogBudget`` tracks before it forgets those past their interval
_MAX_CAUSES = 4096
#: connections accepted per wake-up of the listening socket (asyncio's own loop takes its whole backlog)
_ACCEPTS_PER_WAKE = 16
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


def default_max_connections() -> int:
    """The connection cap for this process: its fd soft limit less a quarter (at least 64) kept for the rest."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS_CEILING
    return max(8, min(_MAX_CONNECTIONS_CEILING, soft - max(64, soft // 4)))


class LogBudget:
    """At most one log line per cause every ``interval`` seconds; the next one says how many were dropped."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._next: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def _forget_old(self, now: float) -> None:
        """Drop causes whose interval passed with nothing dropped (keeps the table as small as the live causes)."""
        for cause in [c for c, until in self._next.items() if until <= now and c not in self._dropped]:
            del self._next[cause]

    def take(self, cause: str) -> int | None:
        """None when this line must be dropped; else how many lines of ``cause`` were dropped before it."""
        now = self.clock()
        if len(self._next) > _MAX_CAUSES:
            self._forget_old(now)
        if now < self._next.get(cause, 0.0):
            self._dropped[cause] = self._dropped.get(cause, 0) + 1
            return None
        self._next[cause] = now + self.interval
        return self._dropped.pop(cause, 0)

    def event(
        self, logger: logging.Logger, name: str, level: int = logging.INFO, *, cause: str = "", **fields: object
    ) -> None:
        """``weightship.logs.event``, rate-limited by ``cause`` (default: ``name``)."""
        dropped = self.take(cause or name)
        if dropped is not None:
            event(logger, name, level, **fields, **({"suppressed": dropped} if dropped else {}))


class ListenerBounds:
    """Caps and idle timeouts for the connections of one aiohttp listener (see the module docstring)."""

    def __init__(
        self,
        what: str,
        log: logging.Logger,
        *,
        max_connections: int | None = None,
        idle_timeout: float = 30.0,
        budget: LogBudget | None = None,
    ) -> None:
        self.what = what
        self.log = log
        self.max_connections = max_connections or default_max_connections()
        self.idle_timeout = idle_timeout
        self.budget = budget or LogBudget()
        self.evicted = 0
        self.refused = 0
        self._server: web.Server | None = None
        self._idle_since: dict[RequestHandler, float] = {}  # live connection -> idle since (absent: busy)
        self._sweeper: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self._pending = 0  # accepted, not yet handed to aiohttp
        self._tasks: set[asyncio.Task[None]] = set()
        self._resume: asyncio.TimerHandle | None = None

    def serve(self, sock: socket.socket, server: web.Server) -> None:
        """Accept connections on listening ``sock`` and hand them to ``server`` (aiohttp's protocol factory)."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._sock = sock
        self._server = server
        loop.add_reader(sock.fileno(), self._acceptable)
        self._sweeper = loop.create_task(self._sweep_loop())

    def _acceptable(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors or buffers: stop accepting for a moment rather than spin on it.
                self.budget.event(self.log, "peer.accept_failed", logging.WARNING, listener=self.what, error=str(exc))
                loop.remove_reader(self._sock.fileno())
                self._resume = loop.call_later(1.0, self._resume_accepting)
                return
            live = self._live()
            if len(live) + self._pending >= self.max_connections and not self._evict_idlest(live):
                self.refused += 1
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(_REFUSAL)
                conn.close()
                self.budget.event(self.log, "peer.connection_refused", logging.WARNING, listener=self.what,
                                  connections=len(live), cap=self.max_connections)  # fmt: skip
                continue
            conn.setblocking(False)
            self._pending += 1
            task = loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._sock is not None:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._acceptable)

    async def _connect(self, conn: socket.socket) -> None:
        assert self._server is not None
        server = self._server
        loop = asyncio.get_running_loop()

        def handler() -> asyncio.BaseProtocol:
            made = server()
            self._idle_since[made] = loop.time()
            return made

        try:
            await loop.connect_accepted_socket(handler, sock=conn)
        except OSError:
            conn.close()
        finally:
            self._pending -= 1

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Marks a connection busy while one of its requests is handled."""
        protocol = request.protocol
        self._idle_since.pop(protocol, None)
        try:
            return await handler(request)
        finally:
            if protocol.transport is not None:
                self._idle_since[protocol] = asyncio.get_running_loop().time()

    def connections(self) -> int:
        """Connections open now."""
        return len(self._live())

    async def stop(self) -> None:
        """Stop accepting (the listening socket is closed) and stop the idle sweep."""
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._resume is not None:
            self._resume.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        self._idle_since.clear()

    def _live(self) -> list[RequestHandler]:
        return self._server.connections if self._server is not None else []

    def _evict_idlest(self, live: list[RequestHandler]) -> bool:
        alive = set(live)
        idle = [(since, id(h), h) for h, since in self._idle_since.items() if h in alive]
        if not idle:
            return False
        _since, _id, handler = min(idle, key=lambda item: (item[0], item[1]))
        self._close(handler)
        self.evicted += 1
        self.budget.event(self.log, "peer.connection_evicted", logging.WARNING, listener=self.what,
                          connections=len(live), cap=self.max_connections)  # fmt: skip
        return True

    def _close(self, handler: RequestHandler) -> None:
        self._idle_since.pop(handler, None)
        handler.force_close()

    async def _sweep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.05, min(self.idle_timeout / 2, 5.0)))
            alive = set(self._live())
            now = loop.time()
            for handler, since in list(self._idle_since.items()):
                if handler not in alive and handler.transport is None:
                    del self._idle_since[handler]
                elif now - since > self.idle_timeout:
                    self._close(handler)
