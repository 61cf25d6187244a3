"""The providers a control plane offers, by kind: spec checks before a rollout starts, measurements while it runs.

A driver holds one :class:`ProviderRegistry` for the life of the process::

    async with ProviderRegistry.default() as providers:
        providers.check_spec(spec)                     # when the rollout is created: refuse bad settings
        ...
        for action in reconciliation.actions:
            if isinstance(action, MeasureMetric):
                results.append(await providers.measure(action, context))

:meth:`ProviderRegistry.measure` never raises for a failed measurement: a provider's
``WeightshipError`` becomes the ``error`` text of the ``MeasurementResult`` the engine expects, so
the analysis' error limits decide, not an exception escaping the driver. ``taken_at`` is read from
the injected clock when the answer arrives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from types import TracebackType

import httpx

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.analysis import is_no_data
from controlplane.rollouts.observations import MeasurementResult
from controlplane.rollouts.providers.base import Provider, ProviderSpecError, RolloutContext
from controlplane.rollouts.providers.builtin import BuiltinProvider
from controlplane.rollouts.providers.prometheus import PrometheusProvider
from controlplane.rollouts.providers.webhook import WebhookProvider
from controlplane.rollouts.spec import AnalysisStep, RolloutSpec
from weightship.errors import TemporaryError, WeightshipError
from weightship.logs import event

__all__ = ["ProviderRegistry"]

_log = logging.getLogger("controlplane.rollouts.providers")


def _utc_now() -> datetime:
    return datetime.now(UTC)


class ProviderRegistry:
    """Providers by kind; ``clock`` gives each measurement's ``taken_at`` (timezone-aware)."""

    def __init__(self, providers: Iterable[Provider], *, clock: Callable[[], datetime] = _utc_now) -> None:
        self._providers: dict[str, Provider] = {}
        for provider in providers:
            if provider.kind in self._providers:
                raise ValueError(f"two providers of kind {provider.kind!r}")
            self._providers[provider.kind] = provider
        self._clock = clock

    @classmethod
    def default(
        cls,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], datetime] = _utc_now,
        builtin: BuiltinProvider | None = None,
    ) -> ProviderRegistry:
        """The Prometheus and webhook providers, and ``builtin`` when given.

        The built-in provider reads the control plane's database, so its driver builds it
        (``BuiltinProvider.for_state(state)``) and passes it here.
        """
        providers: list[Provider] = [
            PrometheusProvider(transport=transport, environ=environ),
            WebhookProvider(transport=transport, environ=environ),
        ]
        if builtin is not None:
            providers.append(builtin)
        return cls(providers, clock=clock)

    @property
    def kinds(self) -> frozenset[str]:
        """The provider kinds this registry can measure with."""
        return frozenset(self._providers)

    def check_spec(self, spec: RolloutSpec) -> None:
        """Check every metric's provider settings; raise :class:`ProviderSpecError` naming the field.

        Also refuses a timeout longer than the metric's interval: a measurement must end before
        the next one is due.
        """
        for step_index, step in enumerate(spec.steps):
            if not isinstance(step, AnalysisStep):
                continue
            for metric_index, metric in enumerate(step.metrics):
                where = f"steps[{step_index}].analysis.metrics[{metric_index}].provider.{metric.provider_kind}"
                provider = self._providers.get(metric.provider_kind)
                if provider is None:
                    raise ProviderSpecError(
                        f"{where}: this control plane has no {metric.provider_kind!r} provider; "
                        f"available: {sorted(self._providers)}"
                    )
                settings = provider.parse(metric.provider, where)
                interval = metric.interval_seconds
                if interval is not None and settings.timeout_seconds > interval:
                    raise ProviderSpecError(
                        f"{where}.timeout: {settings.timeout_seconds:g}s is longer than the metric's interval "
                        f"{interval:g}s; a measurement must end before the next is due: lower the timeout"
                    )

    async def measure(self, action: MeasureMetric, context: RolloutContext) -> MeasurementResult:
        """Take the measurement ``action`` asks for; a failure becomes the result's ``error`` text."""
        started = time.monotonic()
        value: object = None
        error: str | None = None
        temporary = False
        provider = self._providers.get(action.provider_kind)
        try:
            if provider is None:
                raise WeightshipError(
                    f"no {action.provider_kind!r} provider in this control plane (available: {sorted(self._providers)})"
                )
            value = await provider.measure(action, context)
        except WeightshipError as exc:
            error, temporary = exc.message, isinstance(exc, TemporaryError)
        outcome = "error" if error is not None else "no_data" if is_no_data(value) else "value"
        fields: dict[str, object] = {
            "rollout": context.rollout,
            "run": action.run_id,
            "metric": action.metric,
            "index": action.index,
            "kind": action.provider_kind,
            "outcome": outcome,
            "seconds": round(time.monotonic() - started, 3),
        }
        if error is not None:
            fields["error"] = error
            fields["temporary"] = temporary
        event(_log, "analysis.measured", logging.WARNING if error else logging.INFO, **fields)
        return MeasurementResult(action.run_id, action.metric, action.index, self._clock(), value=value, error=error)

    async def aclose(self) -> None:
        """Close every provider's connections."""
        for provider in self._providers.values():
            await provider.aclose()

    async def __aenter__(self) -> ProviderRegistry:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
