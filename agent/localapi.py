"""The local API for model servers on this host: what to serve, waiting for switches, validation.

Bound to localhost or a unix socket and unauthenticated (anyone on the host can already read
the weights). Routes, under ``/local/v1`` (schemas in ``weightship.schemas``)::

    GET  /deployments                                  -> list[LocalDeployment]
    GET  /deployments/{name}                           -> LocalDeployment (404 if never pointed)
    GET  /deployments/{name}/wait?after_epoch=N&timeout=S
                                 -> LocalDeployment once ready at an epoch > N; 204 on timeout
    POST /validation             ValidationReport      -> 204, forwarded in the next heartbeat
    POST /serve-metrics          ServeReport           -> 204, summed per version into the heartbeat
    GET  /status                                       -> NodeHeartbeat (what the agent reports)

``wait`` is both "wait until ready" (``after_epoch=0``) and a long-poll of switches (pass the
epoch you serve). ``path`` is the version directory itself, stable for as long as the version is
referenced; ``<data_dir>/deployments/<name>/current`` is the same directory through a link.
Every error answer is RFC 9457 problem details (``agent.problems``): 400 ``invalid`` for a bad
``wait`` query, 404 ``not_found`` for a deployment never pointed (``no_route`` for an unknown
route), 405, 413, 422 ``invalid_request`` for a malformed validation report, 500 ``internal``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from agent.problems import boundary, problem_response
from agent.serving import Serving
from weightship.errors import NotFoundError, ValidationError
from weightship.logs import event
from weightship.schemas import NodeHeartbeat, ServeReport, ValidationReport

__all__ = ["MAX_WAIT_SECONDS", "LocalAPI"]

log = logging.getLogger("agent.localapi")

MAX_WAIT_SECONDS = 300.0

_Body = TypeVar("_Body", bound=BaseModel)


def _json(model: BaseModel | list[BaseModel], status: int = 200) -> web.Response:
    if isinstance(model, list):
        text = "[" + ",".join(m.model_dump_json() for m in model) + "]"
    else:
        text = model.model_dump_json()
    return web.Response(text=text, status=status, content_type="application/json")


async def _body(request: web.Request, schema: type[_Body]) -> _Body | web.Response:
    """The request's JSON as ``schema``, or the 422 problem naming the first bad field."""
    try:
        return schema.model_validate_json(await request.read())
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return problem_response(422, "invalid_request", f"{where}: {first.get('msg', 'invalid body')}", request.path)


class LocalAPI:
    """The aiohttp application and its listener."""

    def __init__(
        self,
        serving: Serving,
        status: Callable[[], NodeHeartbeat],
        on_report: Callable[[ValidationReport], None],
        on_serve_metrics: Callable[[ServeReport], None] | None = None,
    ) -> None:
        self.serving = serving
        self.status = status
        self.on_report = on_report
        self.on_serve_metrics = on_serve_metrics
        self.app = web.Application(middlewares=[boundary("the local API")])
        self.app.add_routes(
            [
                web.get("/local/v1/deployments", self._list),
                web.get("/local/v1/deployments/{name}", self._get),
                web.get("/local/v1/deployments/{name}/wait", self._wait),
                web.post("/local/v1/validation", self._validation),
                web.post("/local/v1/serve-metrics", self._serve_metrics),
                web.get("/local/v1/status", self._status),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, listen: str) -> str:
        """Listen on ``host:port`` or ``unix:/path``; returns the address (port 0 resolved)."""
        try:
            return await self._start(listen)
        except (OSError, ValueError, OverflowError) as exc:
            await self.stop()
            raise ValidationError(
                f"the local API cannot listen on {listen!r}: {exc}; pick a free address with --local-api "
                "(host:port, port 0 for any free port, or unix:/path)"
            ) from None

    async def _start(self, listen: str) -> str:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site: web.BaseSite
        if listen.startswith("unix:"):
            site = web.UnixSite(self._runner, listen.removeprefix("unix:"))
            await site.start()
            self.url = listen
        else:
            host, _, port = listen.rpartition(":")
            host = host.strip("[]") or "127.0.0.1"
            # Bind first so port 0 resolves to the port actually used.
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
            site = web.SockSite(self._runner, sock)
            await site.start()
            bound = sock.getsockname()[1]
            self.url = f"http://{host}:{bound}" if ":" not in host else f"http://[{host}]:{bound}"
        event(log, "localapi.listening", url=self.url)
        return self.url

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _list(self, _request: web.Request) -> web.Response:
        views = [self.serving.get(r.name) for r in self.serving.book.records()]
        return _json([v for v in views if v is not None])

    async def _get(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        view = self.serving.get(name)
        if view is None:
            raise NotFoundError(
                f"this node has no pointer for deployment {name!r} yet: check the agent serves it "
                "(--deployment) and that the deployment's pointer is set",
                fields={"deployment": name},
            )
        return _json(view)

    async def _wait(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            after = int(request.query.get("after_epoch", "0"))
            timeout = min(float(request.query.get("timeout", "30")), MAX_WAIT_SECONDS)
        except ValueError:
            raise ValidationError(
                "after_epoch must be an integer and timeout a number of seconds", fields={"deployment": name}
            ) from None
        view = await self.serving.wait(name, after, max(0.0, timeout))
        if view is None:
            return web.Response(status=204)
        return _json(view)

    async def _validation(self, request: web.Request) -> web.Response:
        report = await _body(request, ValidationReport)
        if isinstance(report, web.Response):
            return report
        self.on_report(report)
        event(log, "validation.received", deployment=report.deployment, digest=report.digest, passed=report.passed)
        return web.Response(status=204)

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        report = await _body(request, ServeReport)
        if isinstance(report, web.Response):
            return report
        if self.on_serve_metrics is not None:
            self.on_serve_metrics(report)
        return web.Response(status=204)

    async def _status(self, _request: web.Request) -> web.Response:
        return _json(self.status())
