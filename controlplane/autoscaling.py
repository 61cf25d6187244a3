"""Autoscaling signals: per deployment and version, what a scaler should react to, on ``/metrics``.

A GPU node added to a deployment is useful only after it fetched and loaded the weights, minutes
later; GPU utilisation says little about how long requests wait. So the control plane exports the
signals that do (``docs/autoscaling.md``), computed from the model servers' counters that agents
send in heartbeats (``controlplane.traffic``) when ``/metrics`` is scraped, so every replica
reports the same numbers:

``weightship_deployment_queue_depth{deployment,version}``
    requests waiting for a worker now, summed over live nodes;
``weightship_deployment_request_rate{deployment,version}``
    requests per second over the last ``SIGNAL_WINDOW_SECONDS`` (``WEIGHTSHIP_SIGNAL_WINDOW_SECONDS``);
``weightship_deployment_error_ratio{deployment,version}``
    server-side errors per request over that window (absent without requests);
``weightship_deployment_latency_seconds{deployment,version,quantile}``
    p50 and p99 latency over that window (absent without requests);
``weightship_deployment_serving_nodes{deployment,version}``
    live nodes serving the version;
``weightship_deployment_staged_capacity_nodes{deployment,version}``
    live nodes of the deployment holding its stable version verified on disk but not serving it:
    warm capacity that can serve within a load, without a download.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import DeploymentRow, NodeRow, utcnow
from controlplane.rollouts.comparison import histogram_quantile
from controlplane.traffic import FleetSample, Window, live_sample, windows
from weightship.errors import TemporaryError
from weightship.logs import event

__all__ = ["SIGNAL_WINDOW_SECONDS", "AutoscalingCollector", "staged_capacity"]

log = logging.getLogger(__name__)

#: the window rates and latency quantiles are computed over, unless the collector is given another
SIGNAL_WINDOW_SECONDS = 60.0
_LABELS = ["deployment", "version"]


def staged_capacity(stable: str, deployment: str, report: dict[str, Any]) -> bool:
    """Whether a node's ``report`` holds ``stable`` ready on disk while the node does not serve it for ``deployment``."""
    held = any(
        isinstance(item, dict) and item.get("digest") == stable and item.get("state") == "ready"
        for item in report.get("inventory") or ()
    )
    served = next(
        (
            d.get("digest")
            for d in report.get("deployments") or ()
            if isinstance(d, dict) and d.get("name") == deployment
        ),
        None,
    )
    return held and served != stable


class AutoscalingCollector(Collector):
    """Scrape-time autoscaling gauges, read from the database."""

    def __init__(
        self, sessions: sessionmaker[Session], stale_seconds: float, window_seconds: float = SIGNAL_WINDOW_SECONDS
    ) -> None:
        self._sessions = sessions
        self._stale_seconds = stale_seconds
        #: rates and quantiles cover this many seconds; they show once samples cover half of it
        self._window_seconds = window_seconds

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """The gauges above; nothing when the database does not answer (``weightship_database_up`` says so)."""
        now = utcnow()
        try:
            with database_errors("reading autoscaling signals"), self._sessions() as session:
                deployments = session.execute(select(DeploymentRow.name, DeploymentRow.stable)).all()
                nodes = session.execute(
                    select(NodeRow.deployments, NodeRow.report).where(
                        NodeRow.role == "node", NodeRow.last_seen >= now - timedelta(seconds=self._stale_seconds)
                    )
                ).all()
                live = live_sample(session, now, self._stale_seconds)
                found = windows(
                    session, [n for n, _ in deployments], self._window_seconds, now, self._stale_seconds, live
                )
        except TemporaryError as err:
            event(log, "autoscaling.metrics_unavailable", logging.WARNING, error=err.message)
            return
        yield from _traffic_families(live, found, self._window_seconds)
        serving = GaugeMetricFamily(
            "weightship_deployment_serving_nodes", "Live nodes serving the version", labels=_LABELS
        )
        staged = GaugeMetricFamily(
            "weightship_deployment_staged_capacity_nodes",
            "Live nodes holding the deployment's stable version verified but not serving it (warm capacity)",
            labels=_LABELS,
        )
        for name, stable in deployments:
            members = [report or {} for names, report in nodes if name in (names or ())]
            counts: dict[str, int] = {}
            for report in members:
                for d in report.get("deployments") or ():
                    if isinstance(d, dict) and d.get("name") == name and d.get("digest"):
                        counts[d["digest"]] = counts.get(d["digest"], 0) + 1
            for digest, count in sorted(counts.items()):
                serving.add_metric([name, digest], count)
            if stable is not None:
                staged.add_metric([name, stable], sum(staged_capacity(stable, name, r) for r in members))
        yield serving
        yield staged


def _traffic_families(
    live: FleetSample, found: dict[str, Window | None], window_seconds: float
) -> Iterable[GaugeMetricFamily]:
    queue = GaugeMetricFamily(
        "weightship_deployment_queue_depth",
        "Requests waiting for a model-server worker, summed over live nodes",
        labels=_LABELS,
    )
    totals: dict[tuple[str, str], int] = {}
    for sample in live.values():
        for key, depth in sample.queue_depth.items():
            totals[key] = totals.get(key, 0) + depth
    for (name, digest), depth in sorted(totals.items()):
        if name in found:
            queue.add_metric([name, digest], depth)
    yield queue
    rate = GaugeMetricFamily(
        "weightship_deployment_request_rate",
        f"Requests per second over the last {window_seconds:g}s",
        labels=_LABELS,
    )
    errors = GaugeMetricFamily(
        "weightship_deployment_error_ratio",
        f"Server-side errors per request over the last {window_seconds:g}s",
        labels=_LABELS,
    )
    latency = GaugeMetricFamily(
        "weightship_deployment_latency_seconds",
        f"Request latency quantiles over the last {window_seconds:g}s",
        labels=[*_LABELS, "quantile"],
    )
    for name, win in sorted(found.items()):
        if win is None or win.seconds <= 0:
            continue
        for digest, t in sorted(win.versions.items()):
            rate.add_metric([name, digest], t.requests / win.seconds)
            if t.requests:
                errors.add_metric([name, digest], t.errors / t.requests)
            for q in (0.5, 0.99):
                value = histogram_quantile(q, t.latency_buckets())
                if value is not None:
                    latency.add_metric([name, digest, str(q)], value)
    yield rate
    yield errors
    yield latency
