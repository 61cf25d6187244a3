"""The control plane's FastAPI application: wiring, error mapping, health and metrics.

Routes live in modules named after what they manage (``registry``, ``publish``,
``deployments``, ``fleet``, ``tokens``); this module only assembles them. Every
``WeightshipError`` escaping a route becomes an ``ErrorBody`` with the error's status code; a
``TemporaryError`` (503) carries ``Retry-After``. A database that is locked, out of pooled
connections or unreachable answers 503 ``database_unavailable`` within the engine's bounded
waits (``controlplane.persistence.db.make_engine``), never a 500 after a stall. Request bodies are bounded
per route (``controlplane.limits``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import exc, text
from starlette.concurrency import run_in_threadpool

from controlplane.http import state_of
from controlplane.http.limits import BodyLimit
from controlplane.persistence.db import QueryCounter, database_errors, make_engine
from controlplane.settings import Settings
from controlplane.state import AppState
from controlplane.watcher import watching
from weightship.errors import TemporaryError, WeightshipError
from weightship.schemas import ErrorBody, ErrorDetail

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(code=code, message=message))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


async def _sweep_uploads_forever(state: AppState) -> None:
    """Abort abandoned publish sessions (and their multipart uploads) every few minutes."""
    from controlplane.publish import sweep_expired_uploads

    while True:
        await asyncio.sleep(state.settings.upload_sweep_seconds)
        try:
            aborted = await asyncio.to_thread(sweep_expired_uploads, state)
        except WeightshipError as exc:
            log.warning("upload_sweep_failed error=%s", exc.message)
            continue
        if aborted:
            log.info("upload_sweep aborted=%d", aborted)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the application; nothing is opened until start-up."""
    from controlplane import tokens
    from controlplane.http import deployments, fleet, publish, registry
    from controlplane.http import tokens as token_routes
    from controlplane.persistence import migrate
    from controlplane.persistence.store import open_store

    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(
            settings.database_url,
            lock_timeout=settings.database_lock_timeout_seconds,
            pool_timeout=settings.database_pool_timeout_seconds,
            pool_size=settings.database_pool_size,
            statement_timeout=settings.database_statement_timeout_seconds,
        )
        migrate.upgrade(engine)
        state = AppState.open(settings, engine, open_store(settings))
        app.state.ws = state
        tokens.bootstrap_admin(state)
        state.metrics_registry.register(QueryCounter(engine))
        sweeper = asyncio.create_task(_sweep_uploads_forever(state))
        try:
            async with watching(state):
                yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            engine.dispose()

    app = FastAPI(title="weightship control plane", version="1", lifespan=lifespan)
    app.add_middleware(BodyLimit, default_max_bytes=settings.max_body_bytes)

    @app.exception_handler(WeightshipError)
    async def _weightship_error(_request: Request, err: WeightshipError) -> JSONResponse:
        headers: dict[str, str] = {}
        if err.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if isinstance(err, TemporaryError):
            headers["Retry-After"] = str(max(1, math.ceil(err.delay)))
        return _error(err.status_code, err.code, err.message, headers or None)

    async def _database_error(request: Request, err: Exception) -> JSONResponse:
        # A route that does not map database failures itself: the same 503 the mapped ones give.
        try:
            with database_errors(f"{request.method} {request.url.path}"):
                raise err
        except WeightshipError as mapped:
            log.warning("database_unavailable path=%s error=%s", request.url.path, type(err).__name__)
            return await _weightship_error(request, mapped)

    for failure in (exc.OperationalError, exc.InterfaceError, exc.TimeoutError):
        app.add_exception_handler(failure, _database_error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(422, "invalid_request", f"{where}: {first.get('msg', 'invalid request')}")

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz", include_in_schema=False)
    def readyz(request: Request) -> PlainTextResponse:
        """Ready when the database answers, within its bounded waits, and is the file opened at start."""
        state = state_of(request)
        with database_errors("checking readiness"), state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return PlainTextResponse("ready")

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint(request: Request) -> Response:
        state = state_of(request)
        body = await run_in_threadpool(generate_latest, state.metrics_registry)  # the fleet gauges query the database
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    for module in (publish, registry, deployments, fleet, token_routes):
        app.include_router(module.router)
    return app
