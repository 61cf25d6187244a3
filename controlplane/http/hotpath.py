"""The two routes every node calls all the time, answered without the framework's routing.

Heartbeats and desired-state long-polls are nearly all of a fleet's requests, and a pointer
change answers every parked poll at once, which all come back. Through FastAPI's router,
dependencies and responses each request costs the event loop about 0.5 ms, most of it the
framework's. ``HotRoutes`` sits in front of the application and answers the ordinary case of these
two routes itself, with the routes' own functions (``controlplane.http.fleet``):

- ``POST /v1/nodes/{id}/heartbeat`` from the node token of node ``id`` already in the token cache,
  with a declared length within the heartbeat limit and a body that validates;
- ``GET /v1/nodes/{id}/desired`` from that node's token, with a plain ``after``/``wait`` query.

Anything else (a token not in the cache, an admin, another node's id, a body that does not
validate, a query it does not read, a body without a length or over the limit) goes on to the full
application with the body it read replayed, which answers exactly as the routes do (and fills
the token cache for the next request). Errors of the routes' functions leave as the same problem
details the application's handlers give.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.auth import Principal
from controlplane.http.fleet import (
    POLL_AFTER,
    accept_heartbeat,
    desired_answer_when_changed,
    parse_heartbeat,
    poll_after_value,
)
from controlplane.http.limits import HEARTBEAT_MAX_BYTES
from controlplane.http.problems import error_response
from controlplane.persistence.engine import database_errors
from controlplane.state import AppState
from weightship.errors import WeightshipError
from weightship.schemas import Role

__all__ = ["HotRoutes"]

_PREFIX = "/v1/nodes/"
_JSON = [(b"content-type", b"application/json")]
#: the ``wait`` values read here (the route takes any float in [0, 3600]; others go to it)
_WAIT = re.compile(r"\d{1,4}(\.\d{1,6})?")
_MAX_AFTER = 128

#: answers the request and returns None, or returns the ``receive`` the application goes on with
_Handler = Callable[[Scope, Receive, Send, AppState, str], Awaitable[Receive | None]]


class HotRoutes:
    """ASGI middleware answering the ordinary heartbeat and long-poll without the framework."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = _handler(scope)
        if found is not None:
            handler, node_id = found
            rest = await handler(scope, receive, send, scope["app"].state.ws, node_id)
            if rest is None:
                return
            receive = rest
        await self.app(scope, receive, send)


def _handler(scope: Scope) -> tuple[_Handler, str] | None:
    """The hot route ``scope`` asks for, and the node id in its path; None for any other request."""
    if scope["type"] != "http" or scope.get("root_path"):
        return None
    path: str = scope["path"]
    if not path.startswith(_PREFIX):
        return None
    node_id, slash, tail = path[len(_PREFIX) :].partition("/")
    if not node_id or not slash:
        return None
    if tail == "heartbeat" and scope["method"] == "POST":
        return _heartbeat, node_id
    if tail == "desired" and scope["method"] == "GET":
        return _desired, node_id
    return None


def _own_node_principal(scope: Scope, state: AppState, node_id: str) -> Principal | None:
    """The cached principal of the request's token when it is the node token of ``node_id``."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            principal = state.tokens.get(value.decode("latin-1"))
            if principal is not None and principal.role == Role.agent and principal.node_id == node_id:
                return principal
            return None
    return None


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _heartbeat(scope: Scope, receive: Receive, send: Send, state: AppState, node_id: str) -> Receive | None:
    principal = _own_node_principal(scope, state, node_id)
    declared = _declared_length(scope)
    if principal is None or declared is None or declared > HEARTBEAT_MAX_BYTES:
        return receive
    chunks: list[bytes] = []
    size = 0
    more = True
    while more and size <= declared:  # the HTTP parser holds the body to its declared length
        message = await receive()
        if message["type"] != "http.request":
            return None  # the client left: nothing to answer
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        more = message.get("more_body", False)
    raw = b"".join(chunks)
    try:
        body = parse_heartbeat(raw) if not more else None
    except ValidationError:
        body = None
    if body is None:
        return _replay(raw, more, receive)
    try:
        with database_errors(f"POST {scope['path']}"):
            await accept_heartbeat(state, node_id, principal, body, raw)
    except WeightshipError as err:
        await error_response(err, scope["path"])(scope, receive, send)
        return None
    await _answer(send, 204, b"", [])
    return None


def _replay(first: bytes, more: bool, receive: Receive) -> Receive:
    """``receive`` that gives ``first`` (what was already read) before the rest of the body."""
    replayed = False

    async def replaying() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": first, "more_body": more}
        return await receive()

    return replaying


async def _desired(scope: Scope, receive: Receive, send: Send, state: AppState, node_id: str) -> Receive | None:
    if _own_node_principal(scope, state, node_id) is None:
        return receive
    after: str | None = None
    wait = 0.0
    seen: set[str] = set()
    for key, value in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        if key in seen:
            return receive
        seen.add(key)
        if key == "after":
            if len(value) > _MAX_AFTER:
                return receive
            after = value
        elif key == "wait":
            if not _WAIT.fullmatch(value) or float(value) > 3600:
                return receive
            wait = float(value)
    try:
        with database_errors(f"GET {scope['path']}"):
            body, delay = await desired_answer_when_changed(state, node_id, after, wait)
    except WeightshipError as err:
        await error_response(err, scope["path"])(scope, receive, send)
        return None
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    if delay:
        headers.append((POLL_AFTER.lower().encode(), poll_after_value(delay).encode()))
    await _answer(send, 200, body, headers)
    return None
