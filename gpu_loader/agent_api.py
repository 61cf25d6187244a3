"""Client of the agent's local API, as a model server uses it.

The routes are the ones ``weightship.schemas`` documents under ``/local/v1``: what to serve for a
deployment, a long-poll for the next pointer epoch (204 when nothing changed before the
timeout), and the validation report of a loaded version. The agent listens on localhost or on
a unix socket (``unix:/path/agent.sock``). Requests go through the shared HTTP core
(``weightship.http.AsyncSession``): the agent's error answers map to our errors by their code
(``NotFoundError`` for an unknown deployment, and so on); a refused connection, a timeout or a
5xx becomes ``AgentUnavailableError`` (retry later), carrying the agent's ``Retry-After``.
A server pinned to one version asks for it by digest instead (``version``, ``wait_version``),
and holds a lease on it while it runs (``lease``, ``release``), so the agent stages it and never
evicts it. Nothing here retries by itself: ``serve.follow`` and ``serve.pinned`` own the loops
and their backoff.
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx

from gpu_loader.errors import AgentUnavailableError
from gpu_loader.loader import LoadStats
from gpu_loader.validation import ValidationOutcome
from weightship.backoff import Backoff
from weightship.chunkfeed import LocalChunkPage
from weightship.errors import TemporaryError
from weightship.http import AsyncSession, Params, parse, segment
from weightship.schemas import (
    LocalDeployment,
    LocalLease,
    LocalVersion,
    ServeReport,
    ValidationCheck,
    ValidationReport,
)

__all__ = ["LocalAgent", "validation_report"]


class LocalAgent:
    """Talks to the agent on this host."""

    def __init__(self, address: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        if address.startswith("unix:"):
            transport = transport or httpx.AsyncHTTPTransport(uds=address.removeprefix("unix:"))
            base_url = "http://agent"
        else:
            base_url = address.rstrip("/")
        self.address = address
        self._session = AsyncSession(
            base_url,
            service=f"the agent at {address}",
            advice="check that the agent runs on this host and that --agent names its local API",
            transport=transport,
            timeout=10.0,
            backoff=Backoff(attempts=1),
            user_agent="weightship-serve",
        )

    async def _request(
        self,
        method: str,
        path: str,
        *,
        seconds: float = 10.0,
        params: Params | None = None,
        body: ValidationReport | ServeReport | LocalLease | None = None,
    ) -> httpx.Response:
        try:
            return await self._session.send(
                method, path, json=body, params=params, timeout=self._session.read_timeout(seconds)
            )
        except TemporaryError as exc:
            raise AgentUnavailableError(exc.message, delay=max(exc.delay, 1.0)) from None

    async def deployment(self, name: str) -> LocalDeployment:
        """What this host should serve for deployment ``name`` now."""
        return parse(LocalDeployment, await self._request("GET", f"/local/v1/deployments/{segment(name)}"))

    async def wait(self, name: str, after_epoch: int, seconds: float) -> LocalDeployment | None:
        """The deployment once its epoch exceeds ``after_epoch``; ``None`` if ``seconds`` pass first."""
        response = await self._request(
            "GET",
            f"/local/v1/deployments/{segment(name)}/wait",
            params={"after_epoch": after_epoch, "timeout": seconds},
            seconds=seconds + 10.0,
        )
        if response.status_code == 204:
            return None
        return parse(LocalDeployment, response)

    async def version(self, digest: str, deployment: str) -> LocalVersion:
        """Where version ``digest`` of ``deployment`` stands on this host (asking also stages it)."""
        return parse(
            LocalVersion,
            await self._request("GET", f"/local/v1/versions/{segment(digest)}", params={"deployment": deployment}),
        )

    async def wait_version(self, digest: str, deployment: str, seconds: float) -> LocalVersion:
        """Version ``digest`` once it is ready here, or as it stands after ``seconds``."""
        response = await self._request(
            "GET",
            f"/local/v1/versions/{segment(digest)}/wait",
            params={"deployment": deployment, "timeout": seconds},
            seconds=seconds + 10.0,
        )
        return parse(LocalVersion, response)

    async def chunks(
        self, digest: str, deployment: str, *, after: int, feed: str, state: str, seconds: float
    ) -> LocalChunkPage:
        """The chunks of ``digest`` verified since cursor ``after`` of ``feed``, once there are any (``agent.chunkfeed``)."""
        params: Params = {"deployment": deployment, "after": after, "feed": feed, "state": state, "timeout": seconds}
        response = await self._request(
            "GET", f"/local/v1/versions/{segment(digest)}/chunks", params=params, seconds=seconds + 10.0
        )
        return parse(LocalChunkPage, response)

    async def lease(self, holder: str, deployment: str, digest: str, seconds: float) -> LocalVersion:
        """Hold ``digest`` for ``seconds`` (renew before they pass): the agent stages it and never evicts it."""
        body = LocalLease(deployment=deployment, digest=digest, seconds=seconds)
        return parse(LocalVersion, await self._request("PUT", f"/local/v1/leases/{segment(holder)}", body=body))

    async def release(self, holder: str) -> None:
        """Drop ``holder``'s lease (the server stops)."""
        await self._request("DELETE", f"/local/v1/leases/{segment(holder)}")

    async def report(self, report: ValidationReport) -> None:
        """Send a validation report; the agent forwards it to the control plane."""
        await self._request("POST", "/local/v1/validation", body=report)

    async def push_metrics(self, report: ServeReport) -> None:
        """Send the server's cumulative per-version counters; the agent sums them into its heartbeat."""
        await self._request("POST", "/local/v1/serve-metrics", body=report)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._session.aclose()


def validation_report(
    deployment: str,
    digest: str,
    *,
    outcome: ValidationOutcome | None,
    stats: LoadStats | None,
    error: str | None = None,
) -> ValidationReport:
    """The report of one load and validation (``error``: the load itself failed)."""
    checks: list[ValidationCheck] = []
    if stats is not None:
        checks.append(
            ValidationCheck(
                name="load",
                passed=True,
                detail=f"{stats.tensors} tensors, {stats.bytes_read} bytes read in {stats.seconds:.3f}s "
                f"({stats.gbps:.2f} GB/s) onto {stats.device}, verify={stats.verify}",
            )
        )
    if error is not None:
        checks.append(ValidationCheck(name="load", passed=False, detail=error[:2000]))
    if outcome is not None:
        checks.extend(ValidationCheck(name=c.name, passed=c.passed, detail=c.detail[:2000]) for c in outcome.checks)
    passed = error is None and outcome is not None and outcome.passed
    return ValidationReport(
        deployment=deployment,
        digest=digest,
        passed=passed,
        checks=checks,
        load_seconds=stats.seconds if stats is not None else 0.0,
        load_gbps=stats.gbps if stats is not None else 0.0,
        at=datetime.now(UTC),
    )
