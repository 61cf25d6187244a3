"""The Prometheus provider: one PromQL instant query per measurement.

Settings (``provider: {prometheus: {...}}``)::

    address: http://prometheus.monitoring:9090      # required; a path prefix is kept (…/prometheus)
    query: |                                        # required; placeholders: see promql.py
      sum(rate(weightship_serve_requests_total{code!="200", digest="{{canary}}"}[2m]))
      / sum(rate(weightship_serve_requests_total{digest="{{canary}}"}[2m]))
    timeout: 10s                                    # optional, see endpoint.py; also sent to Prometheus
    headers: {Authorization: {fromEnv: PROM_AUTH}}  # optional

The query goes to ``POST <address>/api/v1/query`` (form-encoded, so long queries never hit URL
limits). What ``result`` becomes:

- an instant vector → a list of floats, one per series, ordered by the series' labels (Prometheus
  does not promise an order), so ``result[0]`` is the only series of an aggregated query;
- a scalar → a list of one float, so conditions read ``result[0]`` either way;
- an empty vector → ``[]``, which the analysis counts as **no data** (never as success: a canary
  without traffic proved nothing). ``NaN`` (``0/0`` on a quiet window) is no data as well;
- a range vector, a string, or more than :data:`MAX_SERIES` series → :class:`MeasurementError`
  (aggregate the query), as is a query Prometheus refuses (``bad_data``) or cannot execute.

Prometheus' own timeout answers (HTTP 503) and 5xx are temporary; the next interval asks again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers.base import MeasurementError, RolloutContext
from controlplane.rollouts.providers.endpoint import (
    Answer,
    Header,
    HTTPProvider,
    exchange,
    parse_headers,
    parse_timeout,
    parse_url,
    raise_for_status,
)
from controlplane.rollouts.providers.promql import QueryTemplate, duration, parse_query
from weightship.logs import event

__all__ = ["MAX_SERIES", "PrometheusProvider", "PrometheusSettings"]

_log = logging.getLogger("controlplane.rollouts.providers.prometheus")

def _utc_now() -> datetime:
    return datetime.now(UTC)


#: Every measurement's value is kept in the rollout's status; a metric is a few aggregated series.
MAX_SERIES = 100


@dataclass(frozen=True)
class PrometheusSettings:
    """Checked settings of one Prometheus metric."""

    address: str
    query: QueryTemplate
    timeout_seconds: float
    headers: tuple[Header, ...] = ()

    @property
    def endpoint(self) -> str:
        """The instant-query URL."""
        return self.address.rstrip("/") + "/api/v1/query"


class PrometheusProvider(HTTPProvider):
    """Measures with PromQL instant queries; ``transport`` is the test seam, ``environ`` the secrets' source."""

    kind = "prometheus"
    fields = frozenset({"address", "query", "timeout", "headers"})
    required = ("address", "query")

    def __init__(
        self,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        super().__init__(transport=transport, environ=environ)
        #: the wall clock ``{{window}}`` is measured on: Prometheus answers as of its own now
        self._clock = clock

    def parse(self, raw: Mapping[str, Any], where: str) -> PrometheusSettings:
        """Check the settings; errors name ``where.<field>``."""
        settings = self._checked(raw, where)
        return PrometheusSettings(
            address=parse_url(settings["address"], f"{where}.address"),
            query=parse_query(settings["query"], f"{where}.query"),
            timeout_seconds=parse_timeout(settings.get("timeout"), f"{where}.timeout"),
            headers=parse_headers(settings.get("headers"), f"{where}.headers"),
        )

    async def measure(self, action: MeasureMetric, context: RolloutContext) -> list[float]:
        """Run the metric's query for this rollout; see the module docstring for what comes back."""
        settings = self.parse(action.provider, f"metric {action.metric!r}: provider.prometheus")
        values = {
            "canary": context.canary,
            "stable": context.stable,
            "deployment": context.deployment,
            "rollout": context.rollout,
            "window": None,
        }
        if action.step_started_at is not None:
            # Prometheus evaluates at its own "now": the window runs from the step's start to then.
            values["window"] = duration((self._clock() - action.step_started_at).total_seconds())
        query = settings.query.render(values)
        # Prometheus stops evaluating at its own timeout, a little before ours gives up on it.
        server_timeout_ms = max(int(settings.timeout_seconds * 900), 100)
        what = f"Prometheus at {settings.address}"
        answer = await exchange(
            self._http(),
            "POST",
            settings.endpoint,
            headers=self._headers(settings.headers),
            data={"query": query, "timeout": f"{server_timeout_ms}ms"},
            seconds=settings.timeout_seconds,
            what=what,
        )
        return self._values(answer, what, query)

    def _values(self, answer: Answer, what: str, query: str) -> list[float]:
        body = _json(answer)
        if not 200 <= answer.status < 300 or not isinstance(body, dict) or body.get("status") != "success":
            detail = ""
            if isinstance(body, dict) and body.get("status") == "error":
                detail = f"{body.get('errorType', 'error')}: {body.get('error', '')}"
            raise_for_status(answer, what, detail)
            raise MeasurementError(
                f"{what} did not answer like a Prometheus query API ({detail or _snippet(answer)}); check the address"
            )
        for warning in body.get("warnings") or ():
            event(_log, "prometheus.query_warning", logging.WARNING, address=what, warning=str(warning)[:300])
        data = body.get("data")
        kind = data.get("resultType") if isinstance(data, dict) else None
        result = data.get("result") if isinstance(data, dict) else None
        if kind == "scalar" and isinstance(result, list) and len(result) == 2:
            return [_float(result[1], what)]
        if kind == "vector" and isinstance(result, list):
            if len(result) > MAX_SERIES:
                raise MeasurementError(
                    f"{what}: the query returned {len(result)} series; the limit is {MAX_SERIES}: "
                    f"aggregate it (sum, avg, max by (...)) — query: {query[:200]}"
                )
            series = []
            for sample in result:
                if not isinstance(sample, dict) or not isinstance(sample.get("value"), list):
                    raise MeasurementError(f"{what}: a vector sample without a float value (a native histogram?)")
                labels = sample.get("metric")
                if not isinstance(labels, dict):
                    labels = {}
                series.append((sorted((str(k), str(v)) for k, v in labels.items()), _float(sample["value"][-1], what)))
            return [value for _, value in sorted(series, key=lambda item: item[0])]
        if kind == "matrix":
            raise MeasurementError(
                f"{what}: the query returned a range vector; an instant query must give one value per series: "
                f"wrap the range in rate(), increase() or avg_over_time() — query: {query[:200]}"
            )
        raise MeasurementError(
            f"{what}: a {kind or 'malformed'} result cannot be measured; expected a vector or scalar"
        )


def _json(answer: Answer) -> object:
    try:
        return json.loads(answer.body)
    except (ValueError, RecursionError):  # not JSON, or nested deep enough to exhaust the parser
        return None


def _float(raw: object, what: str) -> float:
    try:
        return float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise MeasurementError(f"{what}: sample value {str(raw)[:40]!r} is not a number") from None


def _snippet(answer: Answer) -> str:
    return answer.body[:120].decode("utf-8", "replace").strip() or "(empty body)"
