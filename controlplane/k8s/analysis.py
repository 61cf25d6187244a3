"""The built-in analysis provider for the operator: settings checked here, measured by the control plane.

The built-in provider (``controlplane.rollouts.providers.builtin``) reads the serving counters
that model servers report through their agents, per version digest, from the control plane's
database. The operator runs outside the control plane, so :class:`RemoteBuiltinProvider` checks a
metric's settings as the built-in provider does (a bad spec is refused before any measurement)
and asks the control plane for each measurement (``POST /v1/deployments/{name}/analysis/builtin``,
operator role). Canary and stable are told apart by digest, so pods of both versions on one node
are judged on their own counters.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers.base import RolloutContext
from controlplane.rollouts.providers.builtin import BuiltinProvider
from weightship.client import Client
from weightship.errors import TemporaryError

__all__ = ["RemoteBuiltinProvider"]

#: The longest window a spec may name here; the control plane refuses one past its own sample retention.
_MAX_WINDOW_SECONDS = 24 * 3600.0


class RemoteBuiltinProvider(BuiltinProvider):
    """``provider: {builtin: {...}}`` for the operator, measured by the control plane over REST."""

    def __init__(self, client: Client) -> None:
        super().__init__(cast(Any, None), stale_seconds=0.0, retention_seconds=_MAX_WINDOW_SECONDS)
        self._client = client

    async def measure(self, action: MeasureMetric, context: RolloutContext) -> object:
        """One measurement of the canary against the stable version, taken by the control plane."""
        settings = self.parse(action.provider, f"metric {action.metric!r}")

        def ask() -> object:
            return self._client.measure_builtin(
                context.deployment,
                metric=action.metric,
                provider=dict(action.provider),
                canary=context.canary,
                stable=context.stable,
            )

        try:
            return await asyncio.wait_for(asyncio.to_thread(ask), settings.timeout_seconds + 5.0)
        except TimeoutError:
            raise TemporaryError(
                f"the control plane did not answer a built-in measurement of metric {action.metric!r} for "
                f"deployment {context.deployment!r} within {settings.timeout_seconds + 5.0:g}s; retrying"
            ) from None
