"""Prometheus metrics of the reference model server.

One registry per server (not the process-global one), so tests can run several. Rollout
analysis reads these: request rate and errors, latency, queue depth (the autoscaling signal),
and for each version its load time, load rate and validation result.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from weightship.schemas import SERVE_LATENCY_BOUNDS, ServeCounters, ServeReport

__all__ = ["LATENCY_BUCKETS", "MAX_TALLIED_VERSIONS", "ServeMetrics", "VersionTallies"]

#: the same bounds the agent and the control plane aggregate with (``weightship.schemas``)
LATENCY_BUCKETS = SERVE_LATENCY_BOUNDS
#: versions whose counters a server keeps; the oldest beyond this are forgotten (a server sees few)
MAX_TALLIED_VERSIONS = 16


@dataclass
class _Tally:
    requests: int = 0
    errors: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(SERVE_LATENCY_BOUNDS) + 1))
    latency_sum: float = 0.0
    load_failures: int = 0
    validations_passed: int = 0
    validations_failed: int = 0


class VersionTallies:
    """Cumulative counters per version digest, pushed to the agent as a ``ServeReport``.

    The Prometheus metrics above are per process; rollout analysis needs them per *version*
    (a swap changes the version mid-process), so requests, errors, latency, load failures and
    validation results are also counted here by the digest that answered. Called from the event
    loop only (no lock needed).
    """

    def __init__(self) -> None:
        self._tallies: dict[str, _Tally] = {}

    def _get(self, digest: str) -> _Tally:
        tally = self._tallies.pop(digest, None) or _Tally()
        self._tallies[digest] = tally  # most recently used last
        while len(self._tallies) > MAX_TALLIED_VERSIONS:
            del self._tallies[next(iter(self._tallies))]
        return tally

    def request(self, digest: str, *, failed: bool, seconds: float) -> None:
        """One request answered by ``digest`` (``failed``: a server-side error)."""
        tally = self._get(digest)
        tally.requests += 1
        tally.errors += failed
        tally.buckets[bisect.bisect_left(SERVE_LATENCY_BOUNDS, seconds)] += 1
        tally.latency_sum += max(0.0, seconds)

    def loaded(self, digest: str, *, load_failed: bool, validation_passed: bool | None) -> None:
        """A load of ``digest`` ended: the load itself failed, or validation passed or failed."""
        tally = self._get(digest)
        tally.load_failures += load_failed
        if validation_passed is not None:
            tally.validations_passed += validation_passed
            tally.validations_failed += not validation_passed

    def report(self, deployment: str, instance: str, *, serving: str | None, queue_depth: int) -> ServeReport:
        """The cumulative counters of every version tallied; the queue depth goes to the served one."""
        versions = []
        for digest, t in self._tallies.items():
            cumulative, running = [], 0
            for count in t.buckets:
                running += count
                cumulative.append(running)
            versions.append(
                ServeCounters(
                    digest=digest,
                    requests=t.requests,
                    errors=t.errors,
                    latency_le=cumulative if t.requests else [],
                    latency_sum=t.latency_sum,
                    load_failures=t.load_failures,
                    validations_passed=t.validations_passed,
                    validations_failed=t.validations_failed,
                    queue_depth=max(0, queue_depth) if digest == serving else 0,
                )
            )
        return ServeReport(deployment=deployment, instance=instance, versions=versions)


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
