"""Prometheus metrics of pointers and the fleet, registered on the app's own registry.

Counters move where things happen (a pointer change, a lost compare-and-swap, a heartbeat);
fleet gauges (nodes live and stale, each deployment's epoch) are read from the database when
``/metrics`` is scraped, so every replica reports the same numbers and nothing drifts.
``create_metrics`` creates and registers them on the app's registry at start-up
(``controlplane.state.AppState.open``), so ``/metrics`` shows every series from the first scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import DeploymentRow, NodeRow, utcnow
from weightship.errors import TemporaryError
from weightship.logs import event

__all__ = ["ControlPlaneMetrics", "FleetCollector", "create_metrics"]

log = logging.getLogger(__name__)



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

    def __init__(self, sessions: sessionmaker[Session], stale_seconds: float) -> None:
        self._sessions = sessions
        self._stale_seconds = stale_seconds

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """Nodes by freshness and the epoch of every deployment; ``weightship_database_up`` 0 when unreadable."""
        stale_before = utcnow() - timedelta(seconds=self._stale_seconds)
        up = GaugeMetricFamily("weightship_database_up", "1 when the database answered this scrape, else 0")
        try:
            with database_errors("reading fleet metrics"), self._sessions() as session:
                total = session.scalar(select(func.count()).select_from(NodeRow)) or 0
                live = (
                    session.scalar(select(func.count()).select_from(NodeRow).where(NodeRow.last_seen >= stale_before))
                    or 0
                )
                epochs = session.execute(select(DeploymentRow.name, DeploymentRow.epoch)).all()
        except TemporaryError as err:
            # The counters still scrape; the alert on weightship_database_up says why the gauges are gone.
            event(log, "metrics.database_unavailable", logging.WARNING, error=err.message)
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


def create_metrics(registry: CollectorRegistry, sessions: sessionmaker[Session], stale_seconds: float) -> ControlPlaneMetrics:
    """Our counters and gauges, registered on ``registry``; fleet gauges read through ``sessions``."""
    registry.register(FleetCollector(sessions, stale_seconds))
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
