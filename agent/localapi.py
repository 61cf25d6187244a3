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
    GET  /versions/{digest}?deployment=D                -> LocalVersion: ready (with path), fetching,
                                                           failed or unknown, with the reason
    GET  /versions/{digest}/wait?deployment=D&timeout=S -> LocalVersion once ready, or as it stands
                                                           when the timeout passes
    GET  /versions/{digest}/chunks?after=N&feed=F&state=S&deployment=D&timeout=S
                                 -> LocalChunkPage: the chunks verified since cursor N, in arrival
                                    order, once there are any (or the state changes, or the timeout
                                    passes); what a streaming load reads (``agent.chunkfeed``)
    PUT  /leases/{holder}        LocalLease            -> LocalVersion; the version is never evicted
                                                           while the lease lives
    DELETE /leases/{holder}                            -> 204 (the holder stopped serving)

and ``GET /metrics`` (outside ``/local/v1``): the agent's Prometheus metrics (``agent.metricsserver``).

``wait`` is both "wait until ready" (``after_epoch=0``) and a long-poll of switches (pass the
epoch you serve). A model server pinned to one version (``weightship-serve --digest``) uses the
``versions`` and ``leases`` routes instead and never follows a pointer: asking for a version and
naming its deployment is also a request to stage it (``agent.pins``), and a lease keeps it on disk
while the server runs. ``path`` is the version directory itself, stable for as long as the version is
referenced; ``<data_dir>/deployments/<name>/current`` is the same directory through a link.
Every error answer is RFC 9457 problem details (``agent.problems``): 400 ``invalid`` for a bad
``wait`` query, 404 ``not_found`` for a deployment never pointed (``no_route`` for an unknown
route), 405, 413, 422 ``invalid_request`` for a malformed validation report, 500 ``internal``.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable
from typing import Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from agent.chunkfeed import ChunkFeeds
from agent.metricsserver import metrics_handler
from agent.pins import ASK_SECONDS, Pins
from agent.problems import boundary, problem_response
from agent.serving import Serving
from weightship.chunkfeed import LocalChunkPage
from weightship.errors import NotFoundError, ValidationError
from weightship.logs import event
from weightship.schemas import LocalLease, LocalVersion, NodeHeartbeat, ServeReport, ValidationReport

__all__ = ["MAX_WAIT_SECONDS", "LocalAPI"]

log = logging.getLogger("agent.localapi")

MAX_WAIT_SECONDS = 300.0

_Body = TypeVar("_Body", bound=BaseModel)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_HOLDER = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class Versions(Protocol):
    """What the local API needs to answer for versions asked by digest (the reconciler)."""

    pins: Pins

    def describe(self, digest: str, deployment: str | None) -> LocalVersion:
        """Where ``digest`` stands on this node, and why."""
        ...


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
        versions: Versions | None = None,
        on_pinned: Callable[[], None] = lambda: None,
        metrics: Callable[[], str] | None = None,
        chunks: ChunkFeeds | None = None,
    ) -> None:
        self.serving = serving
        self.chunks = chunks
        self.versions = versions
        #: called after every ask, lease and release (the agent follows deployments and stages versions)
        self.on_pinned = on_pinned
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
                web.get("/local/v1/versions/{digest}", self._version),
                web.get("/local/v1/versions/{digest}/wait", self._version_wait),
                web.get("/local/v1/versions/{digest}/chunks", self._version_chunks),
                web.put("/local/v1/leases/{holder}", self._lease),
                web.delete("/local/v1/leases/{holder}", self._release),
            ]
        )
        if metrics is not None:
            # The agent's metrics without a peer listener (see agent.metricsserver).
            self.app.router.add_get("/metrics", metrics_handler(metrics))
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

    def _asked(self, request: web.Request) -> tuple[Versions, str, str | None]:
        """The version book, the digest in the path and the ``deployment`` query; 400 if either is malformed."""
        digest = request.match_info["digest"]
        deployment = request.query.get("deployment") or None
        if not _DIGEST.match(digest):
            raise ValidationError(
                f"{digest!r} is not a version digest: ask for sha256:<64 hex digits>", fields={"digest": digest[:80]}
            )
        if deployment is not None and not _NAME.match(deployment):
            raise ValidationError(
                f"deployment {deployment[:80]!r} is not a deployment name (lower-case letters, digits, '.', '_', '-')"
            )
        if self.versions is None:
            raise NotFoundError("this agent does not answer for versions by digest (a cache has no model servers)")
        return self.versions, digest, deployment

    async def _version(self, request: web.Request) -> web.Response:
        versions, digest, deployment = self._asked(request)
        versions.pins.ask(deployment, digest)
        self.on_pinned()
        return _json(versions.describe(digest, deployment))

    async def _version_wait(self, request: web.Request) -> web.Response:
        versions, digest, deployment = self._asked(request)
        try:
            # At most half an ask's life: the ask made here keeps the version until the next one.
            timeout = min(float(request.query.get("timeout", "30")), ASK_SECONDS / 2)
        except ValueError:
            raise ValidationError("timeout must be a number of seconds", fields={"digest": digest}) from None
        versions.pins.ask(deployment, digest)
        self.on_pinned()

        def ready() -> LocalVersion | None:
            view = versions.describe(digest, deployment)
            return view if view.path is not None else None

        found = await self.serving.settle(ready, max(0.0, timeout))
        return _json(found or versions.describe(digest, deployment))

    async def _version_chunks(self, request: web.Request) -> web.Response:
        versions, digest, deployment = self._asked(request)
        feeds = self.chunks
        if feeds is None:
            raise NotFoundError("this agent does not stream versions being fetched (a cache has no model servers)")
        try:
            after = int(request.query.get("after", "0"))
            timeout = min(float(request.query.get("timeout", "30")), ASK_SECONDS / 2)
        except ValueError:
            raise ValidationError(
                "after must be an integer and timeout a number of seconds", fields={"digest": digest}
            ) from None
        token = request.query.get("feed", "")[:64]
        known = request.query.get("state", "")[:16]
        versions.pins.ask(deployment, digest)
        self.on_pinned()

        def news() -> LocalChunkPage | None:
            page = feeds.page(digest, after, token, versions.describe(digest, deployment))
            return page if feeds.news(page, token, known) else None

        found = await self.serving.settle(news, max(0.0, timeout))
        return _json(found or feeds.page(digest, after, token, versions.describe(digest, deployment)))

    async def _lease(self, request: web.Request) -> web.Response:
        holder = request.match_info["holder"]
        if not _HOLDER.match(holder):
            raise ValidationError("a lease holder is 1 to 64 of A-Z a-z 0-9 . _ -", fields={"holder": holder[:80]})
        lease = await _body(request, LocalLease)
        if isinstance(lease, web.Response):
            return lease
        if self.versions is None:
            raise NotFoundError("this agent does not answer for versions by digest (a cache has no model servers)")
        self.versions.pins.lease(holder, lease.deployment, lease.digest, lease.seconds)
        self.on_pinned()
        return _json(self.versions.describe(lease.digest, lease.deployment))

    async def _release(self, request: web.Request) -> web.Response:
        holder = request.match_info["holder"]
        if self.versions is not None and self.versions.pins.release(holder):
            event(log, "lease.released", holder=holder)
            self.on_pinned()
        return web.Response(status=204)

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
