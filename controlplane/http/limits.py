"""Request body limits: every route has one, enforced before any handler keeps a byte.

One ASGI middleware (``BodyLimit``) sits in front of the whole application. A route's limit is
the first entry of ``ROUTE_LIMITS`` matching its method and path, else ``Settings.max_body_bytes``
(64 KiB: every JSON body of the API but those listed is far smaller). A body over its limit is
refused with ``413`` and problem details (code ``too_large``, ``controlplane.http.problems``):

- when ``Content-Length`` declares more than the limit, before the body is read;
- when a body without a length (chunked) streams past the limit: the handler's next read fails,
  and whatever the handler would have answered is replaced by the 413.

Either way the connection is closed after the answer; a body at most ``_DRAIN_BYTES`` over the
limit is read and dropped first, so a client that writes its whole body before reading the
answer still sees the 413 rather than a reset connection.

Limits are generous for what each route legitimately carries: a part upload takes one full chunk
(the largest chunk size a manifest may declare; the route itself checks the part's exact length),
an upload session its manifest, a heartbeat a node's whole inventory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.http.problems import PROBLEM_MEDIA_TYPE, problem_bytes
from controlplane.publish import MAX_REQUEST_BYTES
from weightship.chunks import MAX_CHUNK_SIZE
from weightship.errors import PayloadTooLarge
from weightship.logs import event

__all__ = ["HEARTBEAT_MAX_BYTES", "ROUTE_LIMITS", "BodyLimit", "RouteLimit"]

log = logging.getLogger(__name__)

#: a refused body this much over its limit is read and dropped so that the client sees the 413
_DRAIN_BYTES = 1024 * 1024
_DRAIN_SECONDS = 2.0
#: a heartbeat carries a node's whole inventory
HEARTBEAT_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class RouteLimit:
    """The largest body ``method`` on paths matching ``path`` accepts, and what such a body is."""

    method: str
    path: re.Pattern[str]
    max_bytes: int
    what: str


ROUTE_LIMITS: tuple[RouteLimit, ...] = (
    RouteLimit(
        "PUT", re.compile(r"^/v1/uploads/[^/]+/blobs/[^/]+/parts/[^/]+$"), MAX_CHUNK_SIZE, "an upload part (one chunk)"
    ),
    RouteLimit("POST", re.compile(r"^/v1/uploads$"), MAX_REQUEST_BYTES, "an upload session (with its manifest)"),
    RouteLimit("POST", re.compile(r"^/v1/nodes/[^/]+/heartbeat$"), HEARTBEAT_MAX_BYTES, "a heartbeat"),
    RouteLimit("POST", re.compile(r"^/v1/blobs/urls$"), 1024 * 1024, "a blob URL request"),
)


class _TooLarge(PayloadTooLarge):
    """Raised from ``receive`` into the handler; the middleware answers for it."""


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


class BodyLimit:
    """ASGI middleware refusing request bodies over their route's limit with 413."""

    def __init__(self, app: ASGIApp, default_max_bytes: int, routes: Sequence[RouteLimit] = ROUTE_LIMITS) -> None:
        self.app = app
        self.default_max_bytes = default_max_bytes
        self.routes = tuple(routes)

    def limit_for(self, method: str, path: str) -> tuple[int, str]:
        """The limit of ``method path`` and what its body is called in messages."""
        for route in self.routes:
            if route.method == method and route.path.match(path):
                return route.max_bytes, route.what
        return self.default_max_bytes, "a request body"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on with a counting ``receive``; answer 413 for a body over the limit."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, what = self.limit_for(scope["method"], scope["path"])
        declared = _declared_length(scope)
        if declared is not None and declared > max_bytes:
            if declared - max_bytes <= _DRAIN_BYTES:
                await _drain(receive)
            await _refuse(send, scope, max_bytes, what, f"declares {declared} bytes")
            return

        received = 0
        exceeded = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    exceeded = True
                    raise _TooLarge(f"{what} may be at most {max_bytes} bytes")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                return  # the 413 below replaces whatever the handler makes of the failed read
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded:
            if started:
                event(log, "body_limit.after_response", logging.WARNING, method=scope["method"], path=scope["path"])
                return
            await _drain(receive)
            await _refuse(send, scope, max_bytes, what, f"sent more than {max_bytes} bytes")


async def _drain(receive: Receive) -> None:
    """Read and drop what the client is still sending, up to ``_DRAIN_BYTES`` and ``_DRAIN_SECONDS``.

    A client that writes its whole body before reading the answer then sees the 413 rather than
    a reset connection; one sending more, or slowly, is cut off (the connection is closed).
    """
    dropped = 0
    with anyio.move_on_after(_DRAIN_SECONDS):
        while dropped <= _DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))


async def _refuse(send: Send, scope: Scope, max_bytes: int, what: str, how: str) -> None:
    message = (
        f"{what} to {scope['method']} {scope['path']} may be at most {max_bytes} bytes and this request {how}; "
        "nothing of it was kept: send a smaller body"
    )
    event(
        log,
        "body_limit.too_large",
        logging.WARNING,
        method=scope["method"],
        path=scope["path"],
        limit=max_bytes,
        detail=how,
    )
    body = problem_bytes(PayloadTooLarge.status_code, PayloadTooLarge.code, message, scope["path"])
    await send(
        {
            "type": "http.response.start",
            "status": PayloadTooLarge.status_code,
            "headers": [
                (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
