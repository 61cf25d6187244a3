"""Model servers' serving counters on this node, summed per deployment and version for the heartbeat.

Each model server pushes its cumulative counters per version (``ServeReport``, through the local
API) every few seconds. The node reports one monotonic sum per (deployment, version): on every
push the book adds what each counter grew since that server's previous push. A server that
restarted (a new ``instance``) or whose counters went down starts from 0, so its new counts are
added whole and nothing ever goes negative. The sums are monotonic from ``since`` (this agent's
start); the control plane treats a changed ``since`` as a reset of the node's counters.

Queue depth is a gauge: the sum of the latest value of each server heard from within
``LIVE_SECONDS``. Bounded: at most ``MAX_INSTANCES`` servers and ``MAX_VERSIONS`` sums are kept,
the least recently updated dropped first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from weightship.schemas import (
    SERVE_COUNTERS,
    SERVE_LATENCY_BOUNDS,
    NodeServeMetrics,
    ServeCounters,
    ServeReport,
    VersionServeMetrics,
    counters_reset,
)

__all__ = ["LIVE_SECONDS", "MAX_INSTANCES", "MAX_VERSIONS", "ServeMetricsBook"]

#: a server not heard from for this long no longer adds to the queue depth
LIVE_SECONDS = 60.0
MAX_INSTANCES = 64
MAX_VERSIONS = 32

_Key = tuple[str, str]  # (deployment, digest)


@dataclass
class _Sum:
    requests: int = 0
    errors: int = 0
    load_failures: int = 0
    validations_passed: int = 0
    validations_failed: int = 0
    latency_le: list[int] = field(default_factory=lambda: [0] * (len(SERVE_LATENCY_BOUNDS) + 1))
    latency_sum: float = 0.0
    observed: bool = False


@dataclass
class _Instance:
    deployment: str
    seen: float
    last: dict[str, ServeCounters] = field(default_factory=dict)


class ServeMetricsBook:
    """Per-node sums of the model servers' counters; ``clock`` is monotonic seconds (a test seam)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.since = datetime.now(UTC)
        self._clock = clock
        self._instances: dict[str, _Instance] = {}
        self._sums: dict[_Key, _Sum] = {}

    def receive(self, report: ServeReport) -> None:
        """Add what ``report``'s counters grew since its server's previous report."""
        now = self._clock()
        instance = self._instances.pop(report.instance, None)
        if instance is None or instance.deployment != report.deployment:
            instance = _Instance(report.deployment, now)
        instance.seen = now
        self._instances[report.instance] = instance
        while len(self._instances) > MAX_INSTANCES:
            del self._instances[next(iter(self._instances))]
        for counters in report.versions:
            before = instance.last.get(counters.digest)
            base = ServeCounters(digest=counters.digest) if before is None or counters_reset(before, counters) else before
            self._add((report.deployment, counters.digest), base, counters)
            instance.last[counters.digest] = counters

    def _add(self, key: _Key, base: ServeCounters, now: ServeCounters) -> None:
        total = self._sums.pop(key, None) or _Sum()
        self._sums[key] = total  # most recently updated last
        while len(self._sums) > MAX_VERSIONS:
            del self._sums[next(iter(self._sums))]
        for name in SERVE_COUNTERS:
            setattr(total, name, getattr(total, name) + getattr(now, name) - getattr(base, name))
        if now.latency_le:
            previous = base.latency_le or [0] * len(now.latency_le)
            total.latency_le = [t + n - p for t, n, p in zip(total.latency_le, now.latency_le, previous, strict=True)]
            total.latency_sum += max(0.0, now.latency_sum - base.latency_sum)
            total.observed = True

    def snapshot(self) -> NodeServeMetrics | None:
        """The sums for the heartbeat; None until a model server has reported."""
        if not self._sums:
            return None
        live_after = self._clock() - LIVE_SECONDS
        queued: dict[_Key, int] = {}
        instances: dict[_Key, int] = {}
        for instance in self._instances.values():
            if instance.seen < live_after:
                continue
            for digest, counters in instance.last.items():
                key = (instance.deployment, digest)
                queued[key] = queued.get(key, 0) + counters.queue_depth
                instances[key] = instances.get(key, 0) + 1
        versions = [
            VersionServeMetrics(
                deployment=deployment,
                digest=digest,
                requests=total.requests,
                errors=total.errors,
                latency_le=total.latency_le if total.observed else [],
                latency_sum=total.latency_sum,
                load_failures=total.load_failures,
                validations_passed=total.validations_passed,
                validations_failed=total.validations_failed,
                queue_depth=queued.get((deployment, digest), 0),
                instances=instances.get((deployment, digest), 0),
            )
            for (deployment, digest), total in sorted(self._sums.items())
        ]
        return NodeServeMetrics(since=self.since, versions=versions)
