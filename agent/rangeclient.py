"""HTTP/1.1 range reads straight into chunk buffers: the agent's blob transport.

Why not aiohttp or httpx here: blob reads are the agent's hot path, and on the bench machine
aiohttp's body iteration (a new ``bytes`` per socket read, then a copy into the chunk buffer)
received about 0.5 GB/s over loopback where ``curl`` got about 2 GB/s. An asyncio
``BufferedProtocol`` lets the kernel copy the body straight into the chunk's preallocated buffer
(``recv_into``) and reached about 1.5 GB/s (``bench/fetch.py``). A blob read needs very little
of HTTP: ``GET`` with ``Range``, a ``Content-Length`` body, keep-alive, TLS for presigned S3
URLs. Everything else the agent says over HTTP (control-plane API, local API) uses the
libraries.

Peers and caches serve chunks the same way (``GET /v1/chunks/...``, a ``Content-Length`` body),
so ``get`` reads those into chunk buffers too: on the fan-out bench, aiohttp's receive path was
the largest share of a node agent's CPU.

On plain TCP the connection asks the kernel (``SO_RCVLOWAT``) to wake the reader only once
``WAKE_BYTES`` of the body (or all that is left of it) have arrived: on a link shaped to
100 Mbit/s, segments trickle in and every wake-up of the event loop costs more than the copy.
Not on TLS, where the bytes left of a body and the bytes left on the socket differ.

Errors come out as ours: a refused or expired URL (401/403/404/410) is ``UrlRejected``, network
trouble and 5xx are ``TemporaryError``, answers that break the contract (no ranges, chunked
bodies, a range other than the one asked for) are ``StoreError``, and a body longer than the
chunk is an ``IntegrityError`` before a byte of it is read. ``get`` answers any status but 200
with ``HttpAnswer``, which carries the status and (up to 64 KiB of) the body for the caller to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from weightship.errors import IntegrityError, StoreError, TemporaryError

__all__ = ["HttpAnswer", "RangeClient", "UrlRejected"]

_HEAD_LIMIT = 64 * 1024
_ERROR_BODY_LIMIT = 64 * 1024
#: body bytes the kernel gathers before it wakes the reader (``SO_RCVLOWAT``; plain TCP only)
WAKE_BYTES = 256 * 1024


class UrlRejected(TemporaryError):
    """The origin refused a blob URL (expired or revoked); a fresh one is needed."""


class HttpAnswer(TemporaryError):
    """``RangeClient.get`` got a status other than 200: its status, headers and (at most 64 KiB of) body."""

    def __init__(self, message: str, *, status: int, headers: dict[str, str], body: bytes) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.body = body


@dataclass(frozen=True, slots=True)
class _Head:
    version: str
    status: int
    headers: dict[str, str]

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        return self.version == "HTTP/1.1" and connection != "close"


def _parse_head(raw: bytes) -> _Head:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not _digits(parts[1]):
        raise StoreError(f"the server answered something that is not HTTP: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return _Head(parts[0], int(parts[1]), headers)


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection; the body of a response lands in the buffer ``expect_body`` names."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.progress = 0  # bytes received on this connection, for the inactivity timeout
        self._scratch = bytearray(_HEAD_LIMIT)
        # Always hand out views: asyncio's TLS reader slices the buffer it gets to fill the rest,
        # and slicing a bytearray copies (the bytes would land in the copy and be lost).
        self._scratch_view = memoryview(self._scratch)
        self._head = bytearray()
        self._in_body = False
        self._target = memoryview(bytearray(0))
        self._got = 0
        self._waiter: asyncio.Future[None] | None = None
        self._leftover = b""
        self.head: _Head | None = None
        self._sock: socket.socket | None = None  # set on plain TCP: ``SO_RCVLOWAT`` is tuned per body
        self._lowat = 1

    # --- asyncio protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if transport.get_extra_info("sslcontext") is None and sock is not None and hasattr(socket, "SO_RCVLOWAT"):
            self._sock = sock

    def _wake_at(self, nbytes: int) -> None:
        """Have the kernel report the socket readable once ``nbytes`` are queued (no-op off plain TCP)."""
        nbytes = max(1, nbytes)
        if self._sock is not None and nbytes != self._lowat and not self.closed:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
                self._lowat = nbytes

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._in_body and self._got < len(self._target):
            return self._target[self._got :]
        return self._scratch_view

    def buffer_updated(self, nbytes: int) -> None:
        self.progress += nbytes
        if self._in_body and self._got < len(self._target):
            self._got += nbytes
            left = len(self._target) - self._got
            if left == 0:
                self._wake_at(1)  # the next response's head: every byte of it at once
                self._wake()
            elif left < self._lowat:
                self._wake_at(left)
            return
        if self._in_body or self._waiter is None or self.head is not None:
            self._fail(StoreError("the server sent bytes beyond the response it announced"))
            return
        self._head += self._scratch[:nbytes]
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _HEAD_LIMIT:
                self._fail(StoreError("the server sent response headers larger than 64 KiB"))
            return
        try:
            self.head = _parse_head(bytes(self._head[:end]))
        except StoreError as exc:
            self._fail(exc)
            return
        self._leftover = bytes(self._head[end + 4 :])
        self._head.clear()
        # Hold further bytes in the socket until the caller says where the body goes.
        assert self.transport is not None
        self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(TemporaryError(f"the server closed the connection{f': {exc}' if exc else ''}"))

    # --- used by RangeClient ------------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        # Detach the caller's buffer first: it goes back to the pool and must never be written
        # by a connection that is shutting down (a TLS close can still deliver records).
        self._in_body = False
        self._target = memoryview(bytearray(0))
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def start(self, request: bytes) -> asyncio.Future[None]:
        """Send ``request``; the returned future resolves when the response head has arrived."""
        assert self.transport is not None
        self.head = None
        self._in_body = False
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._waiter

    def expect_body(self, target: memoryview) -> asyncio.Future[None]:
        """Receive the body into ``target`` (exactly its length); resolves when it is full."""
        self._waiter = asyncio.get_running_loop().create_future()
        leftover = self._leftover
        self._leftover = b""
        if len(leftover) > len(target):
            self._fail(StoreError("the server sent more bytes than its Content-Length"))
            return self._waiter
        target[: len(leftover)] = leftover
        self._target = target
        self._got = len(leftover)
        self._in_body = True
        if self._got == len(target):
            self._wake()
        else:
            self._wake_at(min(WAKE_BYTES, len(target) - self._got))
        assert self.transport is not None
        self.transport.resume_reading()
        return self._waiter

    def finish_body(self) -> None:
        """The body is consumed; the connection may carry the next request."""
        self._wake_at(1)
        self._in_body = False
        self._target = memoryview(bytearray(0))
        self._got = 0
        self._waiter = None  # bytes arriving now are unsolicited: the connection is closed

    @property
    def received(self) -> int:
        """Body bytes received so far for the current response."""
        return self._got


class RangeClient:
    """GETs into buffers (ranges of blobs, whole chunks) over a small pool of keep-alive connections per server."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: int = 32,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.ssl_context = ssl_context
        self.max_idle = max_idle
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}

    async def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def get_range(self, url: str, start: int, into: memoryview, on_bytes: Callable[[int], None]) -> None:
        """Fill ``into`` with bytes ``start .. start+len(into)`` of the blob at ``url``.

        ``on_bytes`` hears how many body bytes came off the wire, whether or not the read succeeds.
        """
        length = len(into)

        def check(head: _Head) -> int:
            return self._check_head(head, url, start, length)

        await self._exchange(url, {"Range": f"bytes={start}-{start + length - 1}"}, into, on_bytes, check)

    async def get(
        self, url: str, into: memoryview, on_bytes: Callable[[int], None], headers: Mapping[str, str] | None = None
    ) -> None:
        """Fill ``into`` with the body of ``GET url``: a 200 whose ``Content-Length`` is exactly ``len(into)``.

        Any other status raises ``HttpAnswer`` (status, headers, up to 64 KiB of body); a longer
        body is an ``IntegrityError`` before a byte of it is read, a shorter one a ``TemporaryError``.
        """
        length = len(into)
        where = _where(url)

        def check(head: _Head) -> int:
            if head.status != 200:
                return -1
            if "chunked" in head.headers.get("transfer-encoding", "").lower():
                raise StoreError(f"{where} sent a chunked body; chunk reads need Content-Length")
            announced = head.headers.get("content-length", "")
            if not _digits(announced):
                raise StoreError(f"{where} answered 200 without a Content-Length")
            if int(announced) > length:
                raise IntegrityError(f"{where} would send {announced} bytes for a {length}-byte chunk; refused unread")
            if int(announced) < length:
                raise TemporaryError(f"{where} would send {announced} of the {length} bytes of the chunk")
            return length

        await self._exchange(url, headers or {}, into, on_bytes, check)

    async def _exchange(
        self,
        url: str,
        headers: Mapping[str, str],
        into: memoryview,
        on_bytes: Callable[[int], None],
        check: Callable[[_Head], int],
    ) -> None:
        """Send ``GET url`` and receive the body into ``into``; ``check`` returns its length, or -1: not 200."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StoreError(f"URL {_where(url)} is not an http(s) URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        key = (parts.scheme, parts.hostname, port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        into = memoryview(into)  # slices must be views: the body is received in place
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n{extra}"
            "Accept-Encoding: identity\r\nUser-Agent: weightship-agent\r\n\r\n"
        ).encode("latin-1")
        conn = await self._connection(key, parts.hostname, url)
        complete = reusable = False
        received = 0
        try:
            await self._wait(conn, conn.start(request), url)
            head = conn.head
            assert head is not None
            body_length = check(head)
            if body_length < 0:
                body = await self._answer_body(conn, head, url)
                reusable = body is not None and head.keep_alive
                raise HttpAnswer(
                    f"{_where(url)} answered {head.status}",
                    status=head.status,
                    headers=head.headers,
                    body=body or b"",
                )
            await self._wait(conn, conn.expect_body(into[:body_length]), url)
            complete = True
            received = body_length
            conn.finish_body()
            reusable = head.keep_alive
        finally:
            on_bytes(received if complete else conn.received)
            if reusable and not conn.closed:
                self._release(key, conn)
            else:
                conn.close()

    async def _answer_body(self, conn: _Connection, head: _Head, url: str) -> bytes | None:
        """The body of a non-200 answer when it is small and delimited (else None: the connection is not reused)."""
        announced = head.headers.get("content-length", "")
        if not _digits(announced) or int(announced) > _ERROR_BODY_LIMIT:
            return None
        body = bytearray(int(announced))
        await self._wait(conn, conn.expect_body(memoryview(body)), url)
        conn.finish_body()
        return bytes(body)

    async def _connection(self, key: tuple[str, str, int], host: str, url: str) -> _Connection:
        idle = self._idle.get(key, [])
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        ssl_context: ssl.SSLContext | None = None
        if key[0] == "https":
            ssl_context = self.ssl_context or ssl.create_default_context()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, host, key[2], ssl=ssl_context), self.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            raise TemporaryError(f"cannot connect to {_where(url)}: {exc!r}") from None
        return conn

    def _release(self, key: tuple[str, str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()

    async def _wait(self, conn: _Connection, waiter: asyncio.Future[None], url: str) -> None:
        """Wait for ``waiter``; give up after ``read_timeout`` seconds without a byte."""
        seen = conn.progress
        while True:
            done, _pending = await asyncio.wait({waiter}, timeout=self.read_timeout)
            if done:
                waiter.result()  # raises what the connection failed with
                return
            if conn.progress == seen:
                conn.close()
                with contextlib.suppress(BaseException):
                    waiter.cancel()
                raise TemporaryError(f"{_where(url)} sent nothing for {self.read_timeout:.0f}s")
            seen = conn.progress

    @staticmethod
    def _check_head(head: _Head, url: str, start: int, length: int) -> int:
        status = head.status
        if status in (401, 403, 404, 410):
            raise UrlRejected(f"origin answered {status} for {_where(url)}: the blob URL expired or was revoked")
        if status in (408, 429) or status >= 500:
            raise TemporaryError(f"origin answered {status} for {_where(url)}")
        if "chunked" in head.headers.get("transfer-encoding", "").lower():
            raise StoreError(f"origin sent a chunked body for a range of {_where(url)}; blob reads need Content-Length")
        try:
            body_length = int(head.headers["content-length"])
        except (KeyError, ValueError):
            raise StoreError(f"origin answered {status} without a Content-Length for {_where(url)}") from None
        if status == 206:
            expected = f"bytes {start}-{start + length - 1}/"
            if not head.headers.get("content-range", "").startswith(expected):
                raise StoreError(
                    f"origin answered range {head.headers.get('content-range')!r} for {_where(url)}, asked for {expected}"
                )
        elif status == 200:
            if start != 0 or body_length != length:
                # Fine only when the "range" is the whole blob (a one-chunk file).
                raise StoreError(f"origin ignored the Range header for {_where(url)}; it must support range requests")
        else:
            raise StoreError(f"origin answered {status} to a range request for {_where(url)}")
        if body_length > length:
            raise IntegrityError(
                f"origin would send {body_length} bytes for a {length}-byte chunk of {_where(url)}; refused unread"
            )
        if body_length < length:
            raise StoreError(f"origin sent {body_length} of the {length} bytes asked for from {_where(url)}")
        return body_length


def _digits(text: str) -> bool:
    """Whether ``text`` is a decimal number ``int`` takes: ASCII digits only (``str.isdigit`` also takes "²")."""
    return text.isascii() and text.isdigit()


def _where(url: str) -> str:
    """A URL without its query string, which may hold a signature."""
    return url.split("?", 1)[0]
