"""Fault-injecting origins for tests and benchmarks: stand-ins for what weightship talks to, over real HTTP.

- ``Origin``: a blob store with HTTP range requests, standing in for S3 behind presigned URLs
  (for the fetcher's own tests, which hand it URLs directly).
- ``FaultProxy``: an HTTP proxy between agents and the real control plane's blob route, as a
  misbehaving network or CDN would sit there. The control plane runs with
  ``WEIGHTSHIP_PUBLIC_URL`` set to the proxy, so every signed blob URL it issues goes through it
  (the signature covers the path and expiry, which the proxy keeps). The proxy records every range
  it was asked for, and can corrupt the responses a rule selects, slow every answer down, or hold
  requests until released. It runs its own event loop on a thread so that a module-wide control
  plane and proxy outlive each test's event loop.

Our own components (control plane, agent) are never imitated here: tests run the real ones.
Both run on loopback ports chosen by the OS and record what they served, so a test can assert
on the ranges fetched and the bytes moved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from weightship.manifest import Manifest, build_manifest

__all__ = ["TEST_CHUNK", "FaultProxy", "Origin", "Served"]

#: A small chunk size (the smallest allowed) that gives test versions many chunks.
TEST_CHUNK = 64 * 1024
_T = TypeVar("_T")


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
    await site.start()
    host_port = runner.addresses[0]
    return runner, int(host_port[1])


def _parse_range(header: str, size: int) -> tuple[int, int]:
    spec = header.removeprefix("bytes=")
    first, _, last = spec.partition("-")
    return int(first), min(int(last), size - 1) + 1


@dataclass
class Served:
    """One range request that reached the origin (or the proxy)."""

    blob: str
    start: int
    end: int
    complete: bool = False


class Origin:
    """Blobs by sha256 over HTTP with range requests; records what it served."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.served: list[Served] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    def publish(self, model_dir: Path, model: str, chunk_size: int = TEST_CHUNK) -> Manifest:
        """Put a model directory's files in the origin; returns its manifest."""
        manifest = build_manifest(model_dir, model, chunk_size=chunk_size)
        for entry in manifest.files:
            target = self.blobs / entry.sha256
            if not target.exists():
                shutil.copyfile(model_dir / entry.path, target)
        return manifest

    async def start(self) -> None:
        """Listen on a free loopback port."""
        app = web.Application()
        app.router.add_get("/blobs/{sha}", self._blob)
        self._runner, port = await _serve(app)
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha"]
        expires = float(request.query.get("expires", "inf"))
        if expires < time.time():
            return web.Response(status=403, text="URL expired")
        path = self.blobs / sha
        if not path.exists():
            return web.Response(status=404)
        data = path.read_bytes()
        start, end = _parse_range(request.headers.get("Range", f"bytes=0-{len(data) - 1}"), len(data))
        record = Served(sha, start, end)
        self.served.append(record)
        resp = web.Response(
            status=206, body=data[start:end], headers={"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
        )
        record.complete = True
        return resp


def _never(_blob: str, _start: int) -> bool:
    return False


class FaultProxy:
    """Forwards ``GET /v1/blobs/<sha256>?expires=&sig=`` to the control plane, with faults on demand.

    Controls (plain attributes, safe to set from the test's thread):

    - ``corrupt(blob, start) -> bool``: flip one byte in the middle of the responses it selects
      (same length, wrong hash), recorded in ``corrupted``;
    - ``delay``: seconds to wait before answering each request;
    - ``hold_after``: answer that many requests (counted in ``served``), then hold every further
      one until ``release()``.
    """

    def __init__(self) -> None:
        #: the control plane's base URL (set once it is known)
        self.upstream = ""
        self.url = ""
        self.served: list[Served] = []
        self.corrupted: list[tuple[str, int]] = []
        self.corrupt: Callable[[str, int], bool] = _never
        self.delay = 0.0
        self.hold_after: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._released: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- test controls ----------------------------------------------------------------------------

    def reset(self) -> None:
        """No faults, nothing held, nothing recorded."""
        self.release()
        self.corrupt = _never
        self.delay = 0.0
        self.served = []
        self.corrupted = []

    def held(self) -> int:
        """Requests waiting for ``release()`` right now."""
        hold_after = self.hold_after
        if hold_after is None:
            return 0
        return sum(1 for s in self.served[hold_after:] if not s.complete)

    def release(self) -> None:
        """Answer the held requests and stop holding."""
        self.hold_after = None
        if self._thread.is_alive():
            self._run(self._release_all())

    def bytes_served(self) -> int:
        """Bytes of range responses sent in full."""
        return sum(s.end - s.start for s in self.served if s.complete)

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the proxy's loop thread and listen on a free loopback port."""
        self._thread.start()
        self._run(self._start())

    def stop(self) -> None:
        """Release anything held, stop listening and end the thread."""
        self.release()
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=30)

    async def _start(self) -> None:
        self._released = asyncio.Event()
        # A fresh connection per request: the control plane is killed and restarted under us.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False)
        app = web.Application()
        app.router.add_get("/v1/blobs/{sha}", self._forward)
        self._runner, port = await _serve(app)
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _release_all(self) -> None:
        assert self._released is not None
        self._released.set()
        self._released = asyncio.Event()

    # --- the proxy ----------------------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        assert self._released is not None
        sha = request.match_info["sha"]
        first, _, last = request.headers.get("Range", "bytes=0-0").removeprefix("bytes=").partition("-")
        record = Served(sha, int(first), int(last or first) + 1)
        self.served.append(record)
        hold_after = self.hold_after
        if hold_after is not None and len(self.served) > hold_after:
            await self._released.wait()
        if self.delay:
            await asyncio.sleep(self.delay)  # ok-sleep: a deliberately slow origin
        headers = {k: v for k, v in request.headers.items() if k == "Range"}
        try:
            async with self._session.get(f"{self.upstream}{request.rel_url}", headers=headers) as upstream:
                body = bytearray(await upstream.read())
                passed = {k: v for k, v in upstream.headers.items() if k in ("Content-Range", "Content-Type")}
                status = upstream.status
        except aiohttp.ClientError as exc:
            return web.Response(status=502, text=f"fault proxy: upstream unreachable: {exc!r}")
        if status == 206 and body and self.corrupt(sha, record.start):
            body[len(body) // 2] ^= 0xFF  # one flipped byte: same length, wrong hash
            self.corrupted.append((sha, record.start))
        if request.transport is None or request.transport.is_closing():
            return web.Response(status=499)  # the agent is gone (killed while this was held)
        response = web.Response(status=status, body=bytes(body), headers=passed)
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError:
            return response  # the agent hung up mid-answer: not served in full
        record.complete = status == 206
        return response
