"""The peer listener: chunks this agent verified, served by digest to holders of a ticket.

``GET /v1/chunks/<chunk hex>?version=<digest>&blob=<file sha256 hex>&index=<chunk index>``
(``Authorization: Ticket <token>``) answers, in this order of checks:

- 401 without a ticket, or with one that does not verify (``weightship.tickets``);
- 403 when the ticket expired or does not name ``version``;
- 400 for malformed parameters; 404 when this agent does not know ``version`` or does not hold
  the chunk verified; 409 when chunk ``index`` of ``blob`` in that version's manifest is not
  ``<chunk hex>`` (the requester's manifest and ours disagree: never serve bytes under a name
  they do not have);
- 503 + ``Retry-After`` when ``upload_concurrency`` uploads are already running (the requester
  picks another source rather than queueing here);
- every error as RFC 9457 problem details (``agent.problems``), with our stable ``code``;
- 200 with exactly the chunk's bytes, ``Content-Length`` and ``X-Weightship-Chunk: sha256:<hex>``.

What is served comes from a ``ChunkLocator``: on a GPU node, ``VersionChunks`` (chunks of ready
versions, and chunks of versions still being fetched that are already verified and written,
i.e. journaled in their staging area); on a cache, ``agent.cache.ReadThroughCache``. Bytes go
from the file to the socket with ``loop.sendfile`` (``os.sendfile`` on Linux: no copy through
user space), paced by the upload ``TokenBucket`` in ``SLICE``-sized calls when a cap is set.
aiohttp's ``FileResponse`` is not used: it serves a whole file (or a client ``Range``), not a
byte range we choose.

Bounds (``agent.listenerbounds``): at most ``max_connections`` connections (below the fd limit),
idle ones closed after ``idle_timeout``; an upload whose client accepts no bytes for
``send_timeout`` seconds is cut off and frees its slot; request bodies are refused past
``MAX_BODY`` bytes (``GET`` takes none); log lines about connections and uploads are rate-limited
per cause.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from aiohttp import web

from agent.bandwidth import SLICE, TokenBucket
from agent.listenerbounds import ListenerBounds, LogBudget
from agent.problems import boundary
from agent.staging import Staging
from agent.tickets import TicketKeeper
from weightship.digests import is_hex
from weightship.errors import (
    ConflictError,
    NotFoundError,
    PayloadTooLarge,
    TemporaryError,
    ValidationError,
    WeightshipError,
)
from weightship.logs import event
from weightship.manifest import Manifest

__all__ = ["CHUNK_HEADER", "ChunkLocation", "ChunkLocator", "PeerServer", "UploadStats", "VersionChunks", "chunk_path"]

log = logging.getLogger("agent.peerserver")

CHUNK_HEADER = "X-Weightship-Chunk"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
#: a chunk index: ASCII digits only (``str.isdigit`` also takes "²", which ``int`` refuses)
_INDEX = re.compile(r"^[0-9]{1,12}$")
#: largest request body any route of the listener reads (tracker announcements are the largest)
MAX_BODY = 1024 * 1024
#: most bytes handed to the socket per send; each must be taken within ``send_timeout``
_SEND_STEP = 4 * SLICE


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a verified chunk's bytes lie on disk."""

    path: Path
    offset: int
    length: int


class ChunkLocator(Protocol):
    """Finds (or, on a cache, fetches) a verified chunk; ``NotFoundError`` 404, ``ConflictError`` 409."""

    async def locate(self, chunk: str, version: str, blob: str, index: int) -> ChunkLocation:
        """Where chunk ``chunk`` (chunk ``index`` of ``blob`` in ``version``) can be read."""


def chunk_path(manifest: Manifest, chunk: str, blob: str, index: int) -> tuple[int, str]:
    """The file index and path of chunk ``index`` of ``blob`` in ``manifest``, checked to be ``chunk``."""
    for number, entry in enumerate(manifest.files):
        if entry.sha256 == blob:
            if not 0 <= index < len(entry.chunks):
                raise ConflictError(
                    f"blob {blob} has {len(entry.chunks)} chunks in {manifest.digest}; no index {index}"
                )
            if entry.chunks[index] != chunk:
                raise ConflictError(
                    f"chunk {index} of blob {blob} in {manifest.digest} is {entry.chunks[index]}, not {chunk}; "
                    "the requester's manifest differs from ours"
                )
            return number, entry.path
    raise ConflictError(f"version {manifest.digest} has no file with sha256 {blob}")


class VersionChunks:
    """A GPU node's servable chunks: ready versions, and verified chunks of versions being fetched."""

    def __init__(
        self,
        ready: Callable[[], Mapping[str, Manifest]],
        version_path: Callable[[str], Path],
        staging: Mapping[str, Staging],
    ) -> None:
        self.ready = ready
        self.version_path = version_path
        #: stagings of versions being fetched, by digest (the assembler adds and removes them)
        self.staging = staging

    async def locate(self, chunk: str, version: str, blob: str, index: int) -> ChunkLocation:
        """See ``ChunkLocator``."""
        manifest = self.ready().get(version)
        if manifest is not None:
            number, rel = chunk_path(manifest, chunk, blob, index)
            start, end = manifest.files[number].chunk_range(index, manifest.chunk_size)
            return ChunkLocation(self.version_path(version) / rel, start, end - start)
        staging = self.staging.get(version)
        if staging is None:
            raise NotFoundError(f"version {version} is neither ready nor being fetched on this node")
        number, rel = chunk_path(staging.manifest, chunk, blob, index)
        start, end = staging.manifest.files[number].chunk_range(index, staging.manifest.chunk_size)
        # Worker threads add to ``done`` while we read: copy it in one step (atomic in CPython).
        done = frozenset(staging.done)
        if number in staging.linked or (number, index) in done:
            return ChunkLocation(staging.dir / rel, start, end - start)
        manifest = staging.manifest
        for f, c in done:  # the same bytes, verified at another place of this version
            if manifest.files[f].chunks[c] == chunk:
                other_start, other_end = manifest.files[f].chunk_range(c, manifest.chunk_size)
                return ChunkLocation(staging.dir / manifest.files[f].path, other_start, other_end - other_start)
        raise NotFoundError(f"chunk {chunk} of {version} is not verified on this node yet")


@dataclass
class UploadStats:
    """What the peer listener served, for ``/metrics`` and logs."""

    chunks: int = 0
    bytes: int = 0
    refused_busy: int = 0
    refused_ticket: int = 0
    timed_out: int = 0
    active: int = 0


class PeerServer:
    """The ``/v1/chunks`` listener of one agent (node or cache)."""

    def __init__(
        self,
        locator: ChunkLocator,
        tickets: TicketKeeper,
        *,
        upload_concurrency: int = 16,
        upload_bandwidth: float = 0.0,
        extra_routes: Callable[[web.Application], None] | None = None,
        extra_metrics: Callable[[], str] | None = None,
        send_timeout: float = 10.0,
        idle_timeout: float = 30.0,
        max_connections: int | None = None,
    ) -> None:
        self.locator = locator
        self.tickets = tickets
        self.upload_concurrency = upload_concurrency
        self.bucket = TokenBucket(upload_bandwidth)
        self.stats = UploadStats()
        self.url = ""
        self.send_timeout = send_timeout
        self.budget = LogBudget()
        self.bounds = ListenerBounds("peer", log, max_connections=max_connections, idle_timeout=idle_timeout,
                                     budget=self.budget)  # fmt: skip
        self.app = web.Application(
            middlewares=[self.bounds.middleware, boundary("the peer listener", challenge="Ticket"), _no_get_body],
            client_max_size=MAX_BODY,
        )
        self.app.router.add_get("/v1/chunks/{chunk}", self._chunk)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/v1/identity", self._identity)
        self.app.router.add_get("/metrics", self._metrics)
        self.extra_metrics = extra_metrics
        if extra_routes is not None:
            extra_routes(self.app)  # the tracker mounts its routes on the same listener
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str) -> str:
        """Listen on ``host:port`` (port 0 picks one); returns the base URL."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
        except (OSError, ValueError, OverflowError) as exc:
            raise ValidationError(
                f"the peer listener cannot listen on {listen!r}: {exc}; pick another --peer-listen"
            ) from None
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        sock.listen(1024)
        self.bounds.serve(sock, server)
        bound = sock.getsockname()[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.url = f"http://{shown}:{bound}" if ":" not in shown else f"http://[{shown}]:{bound}"
        event(log, "peer.listening", url=self.url, upload_concurrency=self.upload_concurrency,
              upload_bandwidth=int(self.bucket.rate), max_connections=self.bounds.max_connections)  # fmt: skip
        return self.url

    async def stop(self) -> None:
        """Stop listening."""
        await self.bounds.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _identity(self, _request: web.Request) -> web.Response:
        # The node name requesters bind their tickets to (their audience); public, like /healthz.
        return web.json_response({"node": self.tickets.me})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    def metrics_text(self) -> str:
        """This listener's upload counters, then ``extra_metrics`` (the agent's own)."""
        s = self.stats
        text = (
            f"weightship_peer_upload_chunks_total {s.chunks}\n"
            f"weightship_peer_upload_bytes_total {s.bytes}\n"
            f"weightship_peer_uploads_active {s.active}\n"
            f'weightship_peer_refused_total{{reason="busy"}} {s.refused_busy}\n'
            f'weightship_peer_refused_total{{reason="ticket"}} {s.refused_ticket}\n'
            f'weightship_peer_refused_total{{reason="send_timeout"}} {s.timed_out}\n'
            f"weightship_peer_connections {self.bounds.connections()}\n"
            f'weightship_peer_connections_closed_total{{reason="evicted"}} {self.bounds.evicted}\n'
            f'weightship_peer_connections_closed_total{{reason="refused"}} {self.bounds.refused}\n'
        )
        if self.extra_metrics is not None:
            text += self.extra_metrics()
        return text

    @staticmethod
    def _params(request: web.Request) -> tuple[str, str, str, int]:
        chunk = request.match_info["chunk"]
        version = request.query.get("version", "")
        blob = request.query.get("blob", "")
        index = request.query.get("index", "")
        if not is_hex(chunk) or not _DIGEST.match(version) or not is_hex(blob) or not _INDEX.match(index):
            raise ValidationError(
                "GET /v1/chunks/<chunk sha256 hex>?version=sha256:<hex>&blob=<file sha256 hex>&index=<n> expected"
            )
        return chunk, version, blob, int(index)

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        # Errors escape to the listener's boundary (``agent.problems``), which answers problem details.
        chunk, version, blob, index = self._params(request)
        try:
            await self.tickets.check(request.headers.get("Authorization"), version)
        except WeightshipError:
            self.stats.refused_ticket += 1
            raise
        if self.stats.active >= self.upload_concurrency:
            self.stats.refused_busy += 1
            raise TemporaryError(
                f"this agent is already serving {self.stats.active} uploads (its cap); try another source",
                delay=1.0,
            )
        self.stats.active += 1
        try:
            where, fobj = await self._open(chunk, version, blob, index)
            try:
                return await self._send(request, fobj, where, chunk)
            finally:
                fobj.close()
        finally:
            self.stats.active -= 1

    async def _open(self, chunk: str, version: str, blob: str, index: int) -> tuple[ChunkLocation, BinaryIO]:
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            where = await self.locator.locate(chunk, version, blob, index)
            try:
                return where, await loop.run_in_executor(None, _open, where.path)
            except NotFoundError:
                # A staging area renamed into versions/ between the two steps: look it up again.
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send(self, request: web.Request, fobj: BinaryIO, where: ChunkLocation, chunk: str) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={CHUNK_HEADER: f"sha256:{chunk}", "Content-Type": "application/octet-stream"}
        )
        response.content_length = where.length
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("peer went away before the chunk was sent")
        sent = 0
        step = _SEND_STEP if self.bucket.unlimited else max(1, min(SLICE, int(self.bucket.burst)))
        try:
            while sent < where.length:
                n = min(step, where.length - sent)
                await self.bucket.take(n)
                # A client that stops reading must not hold an upload slot: each step has a deadline.
                async with asyncio.timeout(self.send_timeout):
                    await loop.sendfile(transport, fobj, where.offset + sent, n)
                sent += n
        except TimeoutError:
            self.stats.timed_out += 1
            transport.abort()
            self.budget.event(log, "peer.upload_timed_out", logging.WARNING, chunk=chunk, sent=sent, of=where.length,
                              send_timeout=self.send_timeout)  # fmt: skip
            return response
        except ConnectionError as exc:
            # The requester hung up (it cut off a parent it found too slow, or gave up): not our error.
            self.budget.event(log, "peer.upload_aborted", chunk=chunk, sent=sent, of=where.length, error=str(exc))
            return response
        await response.write_eof()
        self.stats.chunks += 1
        self.stats.bytes += sent
        return response


@web.middleware
async def _no_get_body(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A request body no route reads (any on GET), or one past ``MAX_BODY``, is refused before the handler runs."""
    length = request.content_length
    chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    if request.method in ("GET", "HEAD") and (length or chunked):
        raise PayloadTooLarge(f"{request.method} {request.path} takes no request body; send the request without one")
    if length is not None and length > MAX_BODY:
        raise PayloadTooLarge(
            f"{request.method} {request.path}: the body is {length} bytes, more than the {MAX_BODY} the peer "
            "listener accepts; send a smaller one"
        )
    return await handler(request)


def _open(path: Path) -> BinaryIO:
    try:
        # O_NOFOLLOW: a version file is never a symlink; one that is was not placed by us.
        return open(path, "rb", buffering=0, opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW))
    except FileNotFoundError:
        raise NotFoundError(f"{path} vanished (version installed, moved or evicted); ask again") from None
