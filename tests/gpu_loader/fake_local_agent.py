"""A faithful fake of the agent's local API (the ``/local/v1`` routes in ``weightship.schemas``).

The real agent is another component; the model server only sees this HTTP surface. The fake
keeps one ``LocalDeployment`` per name (404 before the first ``publish``), bumps the epoch on
every ``publish``, answers the long-poll as soon as the deployment is ready at an epoch above
``after_epoch`` (204 when ``timeout`` runs out first), and keeps every ``ValidationReport``. It runs its own event loop in a thread, so
synchronous tests drive it directly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from aiohttp import web

from weightship.problems import PROBLEM_MEDIA_TYPE, problem_document
from weightship.schemas import LocalDeployment, ValidationReport

_T = TypeVar("_T")


class FakeLocalAgent:
    """The agent's local API on 127.0.0.1, in a background thread."""

    def __init__(self) -> None:
        self.reports: list[ValidationReport] = []
        self._deployments: dict[str, LocalDeployment] = {}
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-agent", daemon=True)
        self.url = ""
        self._closing = False

    def __enter__(self) -> FakeLocalAgent:
        self._thread.start()
        self.url = self._call(self._start()).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> str:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/local/v1/deployments/{name}", self._get)
        app.router.add_get("/local/v1/deployments/{name}/wait", self._wait)
        app.router.add_post("/local/v1/validation", self._validation)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _stop(self) -> None:
        assert self._runner is not None
        assert self._changed is not None
        self._closing = True  # long-polls still waiting answer 204 now, so shutdown does not wait for them
        async with self._changed:
            self._changed.notify_all()
        await self._runner.cleanup()

    def publish(
        self, name: str, digest: str | None, path: str | None, *, ready: bool = True, model: str = "tiny"
    ) -> int:
        """Point deployment ``name`` at a version (a new, higher epoch); returns the epoch."""
        return self._call(self._publish(name, digest, path, ready, model)).result(timeout=10)

    async def _publish(self, name: str, digest: str | None, path: str | None, ready: bool, model: str) -> int:
        assert self._changed is not None
        previous = self._deployments.get(name)
        epoch = previous.epoch + 1 if previous is not None else 1
        self._deployments[name] = LocalDeployment(
            name=name, model=model, digest=digest, path=path, epoch=epoch, ready=ready
        )
        async with self._changed:
            self._changed.notify_all()
        return epoch

    def reports_for(self, digest: str) -> list[ValidationReport]:
        """Validation reports received for ``digest``."""
        return [r for r in list(self.reports) if r.digest == digest]

    async def _get(self, request: web.Request) -> web.Response:
        deployment = self._deployments.get(request.match_info["name"])
        if deployment is None:
            return _problem(request, 404, "not_found", "no such deployment")
        return web.Response(body=deployment.model_dump_json(), content_type="application/json")

    async def _wait(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            after = int(request.query["after_epoch"])
            timeout = float(request.query.get("timeout", "30"))
        except (KeyError, ValueError):
            return _problem(request, 400, "invalid", "after_epoch and timeout")
        assert self._changed is not None

        def newer() -> bool:
            current = self._deployments.get(name)
            return self._closing or (current is not None and current.ready and current.epoch > after)

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(newer), timeout)
        except TimeoutError:
            return web.Response(status=204)
        if self._closing:
            return web.Response(status=204)
        return web.Response(body=self._deployments[name].model_dump_json(), content_type="application/json")

    async def _validation(self, request: web.Request) -> web.Response:
        try:
            report = ValidationReport.model_validate_json(await request.read())
        except ValueError as exc:
            return _problem(request, 400, "invalid", str(exc))
        self.reports.append(report)
        return web.Response(status=204)


def _problem(request: web.Request, status: int, code: str, detail: str) -> web.Response:
    """An error answered as the real agent answers it: RFC 9457 problem details."""
    body = problem_document(status, code, detail, request.path)
    return web.json_response(body, status=status, content_type=PROBLEM_MEDIA_TYPE)
