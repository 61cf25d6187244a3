"""What an analysis provider is: settings checked once, then one measurement per ``MeasureMetric``.

The engine asks for measurements (``MeasureMetric(run_id, metric, index, provider_kind, provider)``);
a driver hands each to the provider registered for ``provider_kind`` together with the
:class:`RolloutContext` (which rollout, deployment, canary and stable digests) and feeds the answer
back as a ``MeasurementResult``. A provider answers in one of three ways:

- a **value** — a number, a list of numbers, or a mapping: what conditions see as ``result``;
- **no data** — a value the analysis counts as no data (``None``, ``[]``, ``NaN`` inside). The
  provider never turns "nothing to measure" into a number: an empty Prometheus vector is ``[]``,
  not ``0``, so no data is never a success;
- an **error** — it raises a ``WeightshipError``: :class:`weightship.errors.TemporaryError` for
  what may pass (timeout, refused connection, HTTP 5xx/429) and :class:`MeasurementError` for what
  will not (a bad query, HTTP 4xx, an answer that is not what the provider expects). Either is an
  Error measurement; the analysis' ``consecutiveErrorLimit`` decides when errors end the run.

Settings are checked when a rollout is created (:meth:`Provider.parse` with the field's path), so a
typo is refused with the exact field before anything runs, never discovered mid-rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.spec import RolloutSpecError
from weightship.errors import WeightshipError

__all__ = [
    "MeasurementError",
    "Provider",
    "ProviderSettings",
    "ProviderSpecError",
    "RolloutContext",
]


class ProviderSpecError(RolloutSpecError):
    """A metric's provider settings are malformed; the message names the field and what it accepts."""


class MeasurementError(WeightshipError):
    """The provider answered, but not with a measurement (bad query, HTTP 4xx, malformed answer).

    Retrying the same request will not help: fix the query, the URL or the service.
    """

    status_code = 502
    code = "measurement"


@dataclass(frozen=True)
class RolloutContext:
    """What a measurement is about: templated into queries and sent to webhooks.

    ``rollout`` names the rollout (its id in the control plane, or the ``ModelRollout`` name);
    ``canary`` is the version being rolled out and ``stable`` the one it is judged against.
    """

    rollout: str
    deployment: str
    canary: str
    stable: str | None


class ProviderSettings(Protocol):
    """Checked settings of one metric's provider; every provider has a bounded timeout."""

    @property
    def timeout_seconds(self) -> float:
        """The most one measurement may take, connection and answer included."""
        ...


class Provider(Protocol):
    """One kind of analysis provider (``prometheus``, ``webhook``, …)."""

    @property
    def kind(self) -> str:
        """The key under ``provider:`` in a metric spec."""
        ...

    def parse(self, raw: Mapping[str, Any], where: str) -> ProviderSettings:
        """Check the metric's ``raw`` settings; raise :class:`ProviderSpecError` naming ``where`` + the field."""
        ...

    async def measure(self, action: MeasureMetric, context: RolloutContext) -> object:
        """Take one measurement: a value (maybe no data), or raise a ``WeightshipError``."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
