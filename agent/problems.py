"""The agent's one error boundary: every error its listeners answer is RFC 9457 problem details.

The local API (``agent.localapi``) and the peer listener (``agent.peerserver``, with the
tracker's routes of ``agent.tracker_api`` mounted on it) answer an error as
``application/problem+json`` with our stable ``code``, the same document the control plane
sends (built by ``weightship.problems``, the one mapping of every server and client of ours)::

    {"type": "https://weightship.dev/problems/not_found", "title": "Not Found", "status": 404,
     "detail": "this node has no pointer for deployment 'chat' yet: ...",
     "instance": "/local/v1/deployments/chat", "code": "not_found"}

``boundary`` is the aiohttp middleware that maps everything escaping a handler: our
``WeightshipError`` (its status and code; ``Retry-After`` for a ``TemporaryError``), aiohttp's
own refusals (400 ``bad_request``, 404 ``no_route``, 405 ``method_not_allowed``, 413
``too_large``) and anything unexpected (500 ``internal``, logged with its traceback).

``answer_error`` is the client side, for the agent's own aiohttp clients of other agents (chunk
reads from peers and caches, the tracker): the problem an answer carries, read by the same
``weightship.problems.error_from_response`` the control plane's clients use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import aiohttp
import httpx
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from weightship.errors import WeightshipError
from weightship.logs import event
from weightship.problems import PROBLEM_MEDIA_TYPE, error_from_response, error_problem, problem_document

__all__ = ["MAX_ERROR_BODY", "answer_error", "boundary", "error_response", "problem_response"]

log = logging.getLogger("agent.problems")

#: codes of aiohttp's own refusals, by status (the control plane uses the same ones)
_FRAMEWORK_CODES = {400: "bad_request", 404: "no_route", 405: "method_not_allowed", 413: "too_large"}

#: the most of an error answer's body read: a problem is a few hundred bytes, a hostile peer's body unbounded
MAX_ERROR_BODY = 16 * 1024


def problem_response(
    status: int, code: str, detail: str, instance: str, *, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A problem-details answer."""
    body = problem_document(status, code, detail, instance)
    return web.json_response(body, status=status, headers=dict(headers or {}), content_type=PROBLEM_MEDIA_TYPE)


def error_response(err: WeightshipError, instance: str, *, challenge: str) -> web.Response:
    """The problem-details answer of ``err`` escaping a request to ``instance``."""
    body, headers = error_problem(err, instance, challenge=challenge)
    return web.json_response(body, status=err.status_code, headers=headers, content_type=PROBLEM_MEDIA_TYPE)


def _framework(request: web.Request, exc: web.HTTPException, what: str) -> web.Response:
    status = exc.status
    where = f"{request.method} {request.path}"
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after", "www-authenticate")}
    if status == 404:
        detail = f"no route {where} on {what}: check the URL against docs/agent.md"
    elif status == 405:
        allowed = headers.get("Allow", "")
        detail = f"{request.path} does not accept {request.method}" + (f"; it accepts {allowed}" if allowed else "")
    elif status == 413:
        detail = f"{where}: the request body is larger than {what} accepts; send a smaller one"
    else:
        detail = f"{where}: {exc.reason}" + (f" ({exc.text})" if exc.text and exc.text != exc.reason else "")
    code = _FRAMEWORK_CODES.get(status, f"http_{status}")
    return problem_response(status, code, detail, request.path, headers=headers)


def boundary(what: str, *, challenge: str = "Bearer") -> Middleware:
    """Middleware answering every error that escapes a handler of ``what`` (e.g. ``the local API``) as a problem.

    ``challenge`` is the ``WWW-Authenticate`` scheme a 401 names.
    """

    @web.middleware
    async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except WeightshipError as err:
            return error_response(err, request.path, challenge=challenge)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise  # a redirect or an empty success is an answer, not an error
            return _framework(request, exc, what)
        except ConnectionError:
            raise  # the client went away (perhaps mid-body): nobody is left to answer
        except Exception as exc:
            event(
                log,
                "request.failed",
                logging.ERROR,
                method=request.method,
                path=request.path,
                error=type(exc).__name__,
                exc_info=True,
            )
            detail = (
                f"{what} failed on {request.method} {request.path} ({type(exc).__name__}); "
                "this is a bug: check the agent's log, then retry"
            )
            return problem_response(500, "internal", detail, request.path)

    return problems


async def answer_error(response: aiohttp.ClientResponse, what: str) -> WeightshipError:
    """The error a non-2xx ``response`` to ``what`` (e.g. ``peer n2 GET /v1/chunks/...``) means, with its detail."""
    body = bytearray()
    while len(body) < MAX_ERROR_BODY:
        piece = await response.content.read(MAX_ERROR_BODY - len(body))
        if not piece:
            break
        body += piece
    return status_error(response.status, dict(response.headers), bytes(body), what)


def status_error(status: int, headers: dict[str, str], body: bytes, what: str) -> WeightshipError:
    """The error a non-2xx answer (``status``, ``headers``, ``body``) to ``what`` means, with its detail."""
    return error_from_response(httpx.Response(status, headers=list(headers.items()), content=body), what)
