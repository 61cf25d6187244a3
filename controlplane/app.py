"""The control plane's FastAPI application: wiring, error mapping, health and metrics.

Routers live in ``controlplane.http``, in modules named after what they manage (``registry``,
``publish``, ``deployments``, ``fleet``, ``tokens``); this module only assembles them with the
typed ``AppState`` (``controlplane.state``). Every error leaves as RFC 9457 problem details
(``controlplane.http.problems``); a ``TemporaryError`` (503) carries ``Retry-After``. A database
that is locked, out of pooled connections or unreachable answers 503 ``database_unavailable``
within the engine's bounded waits (``controlplane.persistence.engine.make_engine``), never a 500
after a stall. Request bodies are bounded per route (``controlplane.http.limits``). The ordinary
heartbeat and long-poll of a node skip the framework's routing (``controlplane.http.hotpath``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from controlplane.autoscaling import AutoscalingCollector
from controlplane.http import problems, state_of
from controlplane.http.hotpath import HotRoutes
from controlplane.http.limits import BodyLimit
from controlplane.persistence.engine import QueryCounter, database_errors, make_engine
from controlplane.settings import Settings
from controlplane.state import AppState
from controlplane.traffic import sample_forever
from controlplane.watcher import watching
from weightship.errors import WeightshipError
from weightship.logs import event

__all__ = ["create_app"]

log = logging.getLogger(__name__)


async def _sweep_uploads_forever(state: AppState) -> None:
    """Abort abandoned publish sessions (and their multipart uploads) every few minutes."""
    from controlplane.publish import sweep_expired_uploads

    while True:
        await asyncio.sleep(state.settings.upload_sweep_seconds)
        try:
            aborted = await asyncio.to_thread(sweep_expired_uploads, state)
        except WeightshipError as exc:
            event(log, "upload.sweep_failed", logging.WARNING, error=exc.message)
            continue
        if aborted:
            event(log, "upload.sweep", aborted=aborted)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the application; nothing is opened until start-up."""
    from controlplane import tokens, ui
    from controlplane.http import deployments, fleet, publish, registry, rollouts
    from controlplane.http import preheats as preheat_routes
    from controlplane.http import signatures as signature_routes
    from controlplane.http import tickets as ticket_routes
    from controlplane.http import tokens as token_routes
    from controlplane.persistence import migrate
    from controlplane.persistence.store import open_store
    from controlplane.rollout_driver import FleetRolloutDriver
    from controlplane.rollouts.providers import ProviderRegistry
    from controlplane.rollouts.providers.builtin import BuiltinProvider

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
        tokens.bootstrap_tokens(state)
        state.metrics_registry.register(QueryCounter(engine))
        state.metrics_registry.register(
            AutoscalingCollector(state.sessions, settings.node_stale_seconds, settings.signal_window_seconds)
        )
        sweeper = asyncio.create_task(_sweep_uploads_forever(state))
        providers = ProviderRegistry.default(builtin=BuiltinProvider.for_state(state))
        driver = FleetRolloutDriver(state, providers)
        driver.loop = asyncio.get_running_loop()
        state.rollouts = driver
        tasks = [sweeper]
        if settings.rollout_tick_seconds > 0:
            tasks.append(asyncio.create_task(driver.run_forever(settings.rollout_tick_seconds), name="rollouts"))
        sampler = asyncio.create_task(
            sample_forever(
                state.sessions,
                settings.serve_sample_seconds,
                settings.node_stale_seconds,
                settings.serve_sample_retention_seconds,
            )
        )
        tasks.append(sampler)
        try:
            async with watching(state):
                yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await providers.aclose()
            await state.heartbeats.close()
            engine.dispose()

    # No OpenTelemetry: FastAPI would otherwise look for a configured provider on every request.
    no_telemetry: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    app = FastAPI(title="weightship control plane", version="1", lifespan=lifespan, telemetry=no_telemetry)
    app.add_middleware(BodyLimit, default_max_bytes=settings.max_body_bytes)
    app.add_middleware(HotRoutes)  # outside the body limit: it keeps to the heartbeat's own

    problems.install(app)

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

    for module in (
        publish, registry, signature_routes, deployments, fleet, token_routes, ticket_routes, rollouts, preheat_routes
    ):
        problems.document(module.router)
        app.include_router(module.router)
    ui.install(app)
    return app
