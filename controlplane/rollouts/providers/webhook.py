"""The webhook provider: POST what is being judged to a service, read the measurement from its JSON answer.

Settings (``provider: {webhook: {...}}``)::

    url: https://validator.internal/judge     # required; http or https
    jsonPath: $.result.errorRate              # optional, default '$' (the whole answer); see selector.py
    timeout: 10s                              # optional, see endpoint.py
    headers: {Authorization: {fromEnv: VALIDATOR_TOKEN}}

Each measurement is one ``POST`` with a JSON body::

    {"rollout": "…", "deployment": "chat", "canary": "sha256:…", "stable": "sha256:…",
     "metric": "golden-check", "run_id": "…", "index": 0}

``run_id`` and ``index`` name the measurement: a service may use them to answer a repeated request
(after a lost answer) the same way. The answer must be 2xx with a JSON body; the value at
``jsonPath`` becomes ``result``. A missing field or ``null`` is **no data** (never success);
a non-2xx answer or a body that is not JSON is an **Error** measurement (429/5xx and timeouts are
temporary, the rest permanent). Keep ``timeout`` well below the metric's ``interval``: a slow hook
delays the next measurement.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers.base import MeasurementError, RolloutContext
from controlplane.rollouts.providers.endpoint import (
    Header,
    HTTPProvider,
    exchange,
    parse_headers,
    parse_timeout,
    parse_url,
    raise_for_status,
)
from controlplane.rollouts.providers.selector import FieldSelector, parse_selector

__all__ = ["WebhookProvider", "WebhookSettings"]


@dataclass(frozen=True)
class WebhookSettings:
    """Checked settings of one webhook metric."""

    url: str
    selector: FieldSelector
    timeout_seconds: float
    headers: tuple[Header, ...] = ()


class WebhookProvider(HTTPProvider):
    """Measures by asking an HTTP service; ``transport`` is the test seam, ``environ`` the secrets' source."""

    kind = "webhook"
    fields = frozenset({"url", "jsonPath", "timeout", "headers"})
    required = ("url",)

    def parse(self, raw: Mapping[str, Any], where: str) -> WebhookSettings:
        """Check the settings; errors name ``where.<field>``."""
        settings = self._checked(raw, where)
        return WebhookSettings(
            url=parse_url(settings["url"], f"{where}.url"),
            selector=parse_selector(settings.get("jsonPath", "$"), f"{where}.jsonPath"),
            timeout_seconds=parse_timeout(settings.get("timeout"), f"{where}.timeout"),
            headers=parse_headers(settings.get("headers"), f"{where}.headers"),
        )

    async def measure(self, action: MeasureMetric, context: RolloutContext) -> object:
        """POST the context and select the value from the JSON answer (None when it is not there)."""
        settings = self.parse(action.provider, f"metric {action.metric!r}: provider.webhook")
        payload = {
            "rollout": context.rollout,
            "deployment": context.deployment,
            "canary": context.canary,
            "stable": context.stable,
            "metric": action.metric,
            "run_id": action.run_id,
            "index": action.index,
        }
        what = f"webhook {settings.url}"
        answer = await exchange(
            self._http(),
            "POST",
            settings.url,
            headers={
                **self._headers(settings.headers),
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
            content=json.dumps(payload).encode(),
            seconds=settings.timeout_seconds,
            what=what,
        )
        raise_for_status(answer, what)
        try:
            document = json.loads(answer.body)
        except (ValueError, RecursionError):  # not JSON, or nested deep enough to exhaust the parser
            snippet = answer.body[:120].decode("utf-8", "replace").strip() or "(empty body)"
            raise MeasurementError(
                f"{what} answered HTTP {answer.status} with a body that is not JSON: {snippet!r}; "
                "the hook must answer a JSON document"
            ) from None
        return settings.selector.select(document)
