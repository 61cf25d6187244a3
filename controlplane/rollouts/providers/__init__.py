"""Analysis providers: turn a metric's provider settings into a measurement (see ``base.py``)."""

from controlplane.rollouts.providers.base import MeasurementError, Provider, ProviderSpecError, RolloutContext
from controlplane.rollouts.providers.prometheus import PrometheusProvider
from controlplane.rollouts.providers.registry import ProviderRegistry
from controlplane.rollouts.providers.webhook import WebhookProvider

__all__ = [
    "MeasurementError",
    "PrometheusProvider",
    "Provider",
    "ProviderRegistry",
    "ProviderSpecError",
    "RolloutContext",
    "WebhookProvider",
]
