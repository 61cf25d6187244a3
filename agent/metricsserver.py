"""The agent's metrics for Prometheus, wherever it can scrape them.

The same text is served in three places, so a node needs no peer listener to be monitored:

- ``GET /metrics`` on the local API (``--local-api``, loopback by default: a Prometheus agent or
  node exporter on the host scrapes it there);
- ``GET /metrics`` on ``--metrics-listen HOST:PORT`` when set: a listener that serves nothing but
  ``/metrics`` and ``/healthz``, for a Prometheus on another host (the local API's other routes,
  such as leases, stay on loopback);
- ``GET /metrics`` on the peer listener, when there is one (caches; nodes with ``--peer-listen``).

What the text holds: chunk bytes, chunks and errors per source (``weightship_fetch_source_*``),
switch-hook calls, and, on a cache, its hits, misses and upstream reads; where a peer listener
runs, its uploads and refusals too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from weightship.errors import ValidationError
from weightship.logs import event

__all__ = ["MetricsServer", "metrics_handler"]

log = logging.getLogger("agent.metrics")


def metrics_handler(metrics: Callable[[], str]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler answering ``metrics()`` in Prometheus' text format."""

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(text=metrics(), content_type="text/plain")

    return handle


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` on their own listener (``--metrics-listen``)."""

    def __init__(self, metrics: Callable[[], str]) -> None:
        self.app = web.Application()
        self.app.router.add_get("/metrics", metrics_handler(metrics))
        self.app.router.add_get("/healthz", self._healthz)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, listen: str) -> str:
        """Listen on ``host:port`` (port 0: a free one); returns the URL."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, host, int(port))
            await site.start()
        except (OSError, ValueError) as exc:
            await self.stop()
            raise ValidationError(
                f"the metrics listener cannot listen on {listen!r}: {exc}; pick a free host:port with --metrics-listen"
            ) from None
        bound = self._runner.addresses[0][1]
        self.url = f"http://{host}:{bound}" if ":" not in host else f"http://[{host}]:{bound}"
        event(log, "metrics.listening", url=self.url)
        return self.url

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    async def _healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")
