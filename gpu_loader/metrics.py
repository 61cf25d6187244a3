"""Prometheus metrics of the reference model server.

One registry per server (not the process-global one), so tests can run several. Rollout
analysis reads these: request rate and errors, latency, queue depth (the autoscaling signal),
and for each version its load time, load rate and validation result.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["LATENCY_BUCKETS", "ServeMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The server's metrics, registered in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "weightship_serve_requests", "Inference requests, by HTTP status code", ["code"], registry=r
        )
        self.errors = Counter(
            "weightship_serve_request_errors", "Inference requests that failed on the server side", registry=r
        )
        self.latency = Histogram(
            "weightship_serve_request_seconds", "Inference request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("weightship_serve_queue_depth", "Inference requests waiting for a worker", registry=r)
        self.inflight = Gauge("weightship_serve_inflight_requests", "Inference requests being computed", registry=r)
        self.load_seconds = Gauge(
            "weightship_serve_load_seconds", "Seconds the load of a version took", ["digest"], registry=r
        )
        self.load_gbps = Gauge(
            "weightship_serve_load_gbps", "GB/s read while loading a version", ["digest"], registry=r
        )
        self.validation = Gauge(
            "weightship_serve_validation_passed",
            "1 if a version passed load and validation, 0 if it failed",
            ["digest"],
            registry=r,
        )
        self.version = Gauge(
            "weightship_serve_version_info", "1 for the version being served", ["digest", "epoch"], registry=r
        )
        self.ready = Gauge("weightship_serve_ready", "1 while a validated version is being served", registry=r)
        self.swaps = Counter("weightship_serve_swaps", "Switches from one served version to another", registry=r)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
