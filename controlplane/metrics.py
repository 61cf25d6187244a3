"""Prometheus metrics of pointers and the fleet, registered on the app's own registry.

Counters move where things happen (a pointer change, a lost compare-and-swap, a heartbeat);
fleet gauges (nodes live and stale, each deployment's epoch) are read from the database when
``/metrics`` is scraped, so every replica reports the same numbers and nothing drifts.
``metrics_of(state)`` creates and registers them on first use; call it once at start-up to have
the gauges exported before any route ran.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from controlplane.persistence.db import DeploymentRow, NodeRow, utcnow
from controlplane.registry import database_errors
from weightship.errors import TemporaryError

__all__ = ["ControlPlaneMetrics", "FleetCollector", "metrics_of"]

log = logging.getLogger(__name__)

_KEY = "metrics"
_LOCK = threading.Lock()


@dataclass(frozen=True)
class ControlPlaneMetrics:
    """The counters and gauges our routes update."""

    pointer_changes: Counter
    pointer_conflicts: Counter
    node_registrations: Counter
    heartbeats: Counter
    long_polls_waiting: Gauge


class FleetCollector(Collector):
    """Scrape-time gauges computed from the database."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """Nodes by freshness and the epoch of every deployment; ``weightship_database_up`` 0 when unreadable."""
        stale_before = utcnow() - timedelta(seconds=self._state.settings.node_stale_seconds)
        up = GaugeMetricFamily("weightship_database_up", "1 when the database answered this scrape, else 0")
        try:
            with database_errors("reading fleet metrics"), self._state.sessions() as session:
                total = session.scalar(select(func.count()).select_from(NodeRow)) or 0
                live = (
                    session.scalar(select(func.count()).select_from(NodeRow).where(NodeRow.last_seen >= stale_before))
                    or 0
                )
                epochs = session.execute(select(DeploymentRow.name, DeploymentRow.epoch)).all()
        except TemporaryError as err:
            # The counters still scrape; the alert on weightship_database_up says why the gauges are gone.
            log.warning("metrics_database_unavailable error=%r", err.message)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        nodes = GaugeMetricFamily("weightship_nodes", "Registered nodes by heartbeat freshness", labels=["state"])
        nodes.add_metric(["live"], live)
        nodes.add_metric(["stale"], total - live)
        yield nodes
        epoch = GaugeMetricFamily("weightship_pointer_epoch", "Current serving-pointer epoch", labels=["deployment"])
        for name, value in epochs:
            epoch.add_metric([name], value)
        yield epoch


def _create(registry: CollectorRegistry, state: Any) -> ControlPlaneMetrics:
    registry.register(FleetCollector(state))
    return ControlPlaneMetrics(
        pointer_changes=Counter(
            "weightship_pointer_changes",
            "Serving-pointer changes committed",
            ["deployment", "action"],
            registry=registry,
        ),
        pointer_conflicts=Counter(
            "weightship_pointer_conflicts",
            "Pointer updates refused because the If-Match epoch was stale",
            ["deployment"],
            registry=registry,
        ),
        node_registrations=Counter("weightship_node_registrations", "Node (re-)registrations", registry=registry),
        heartbeats=Counter("weightship_node_heartbeats", "Node heartbeats received", registry=registry),
        long_polls_waiting=Gauge(
            "weightship_desired_long_polls", "Desired-state long-polls currently waiting", registry=registry
        ),
    )


def metrics_of(state: Any) -> ControlPlaneMetrics:
    """The metrics of this app (``state`` is its ``AppState``), created on first use."""
    found: ControlPlaneMetrics | None = state.extras.get(_KEY)
    if found is not None:
        return found
    with _LOCK:
        found = state.extras.get(_KEY)
        if found is None:
            found = _create(state.metrics, state)
            state.extras[_KEY] = found
        return found
