"""Client of the agent's local API, as a model server uses it.

The routes are the ones ``weightship.schemas`` documents under ``/local/v1``: what to serve for a
deployment, a long-poll for the next pointer epoch (204 when nothing changed before the
timeout), and the validation report of a loaded version. The agent listens on localhost or on
a unix socket (``unix:/path/agent.sock``). httpx errors are mapped to ``AgentUnavailableError``
(retry later) at this boundary; callers never see an httpx exception.
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx

from gpu_loader.errors import AgentUnavailableError
from gpu_loader.loader import LoadStats
from gpu_loader.validation import ValidationOutcome
from weightship.errors import NotFoundError, ValidationError
from weightship.schemas import LocalDeployment, ValidationCheck, ValidationReport

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
        self._client = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=httpx.Timeout(10.0))

    async def _request(
        self,
        method: str,
        path: str,
        *,
        seconds: float = 10.0,
        params: dict[str, str | int | float] | None = None,
        body: bytes | None = None,
    ) -> httpx.Response:
        headers = {"content-type": "application/json"} if body is not None else None
        try:
            response = await self._client.request(
                method, path, timeout=seconds, params=params, content=body, headers=headers
            )
        except httpx.HTTPError as exc:
            raise AgentUnavailableError(
                f"agent at {self.address} did not answer {method} {path}: {exc!r}", delay=1.0
            ) from None
        if response.status_code == 404:
            raise NotFoundError(f"agent at {self.address}: {method} {path} -> 404 {response.text[:200]}")
        if 400 <= response.status_code < 500:
            raise ValidationError(
                f"agent at {self.address} refused {method} {path}: {response.status_code} {response.text[:200]}"
            )
        if response.status_code >= 500:
            raise AgentUnavailableError(
                f"agent at {self.address}: {method} {path} -> {response.status_code}", delay=2.0
            )
        return response

    async def deployment(self, name: str) -> LocalDeployment:
        """What this host should serve for deployment ``name`` now."""
        response = await self._request("GET", f"/local/v1/deployments/{name}")
        return LocalDeployment.model_validate_json(response.content)

    async def wait(self, name: str, after_epoch: int, seconds: float) -> LocalDeployment | None:
        """The deployment once its epoch exceeds ``after_epoch``; ``None`` if ``seconds`` pass first."""
        response = await self._request(
            "GET",
            f"/local/v1/deployments/{name}/wait",
            params={"after_epoch": after_epoch, "timeout": seconds},
            seconds=seconds + 10.0,
        )
        if response.status_code == 204:
            return None
        return LocalDeployment.model_validate_json(response.content)

    async def report(self, report: ValidationReport) -> None:
        """Send a validation report; the agent forwards it to the control plane."""
        await self._request("POST", "/local/v1/validation", body=report.model_dump_json().encode())

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


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
