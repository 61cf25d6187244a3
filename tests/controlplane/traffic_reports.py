"""Heartbeats carrying model-server counters, as agents send them, for the traffic and built-in provider tests."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from weightship.schemas import SERVE_LATENCY_BOUNDS


def latency_le(latencies: Sequence[float]) -> list[int]:
    """The cumulative histogram of ``latencies`` over the shared bounds (+Inf last)."""
    counts = [0] * (len(SERVE_LATENCY_BOUNDS) + 1)
    for seconds in latencies:
        counts[bisect.bisect_left(SERVE_LATENCY_BOUNDS, seconds)] += 1
    running, cumulative = 0, []
    for count in counts:
        running += count
        cumulative.append(running)
    return cumulative


@dataclass
class Served:
    """One version's cumulative counters on one node."""

    digest: str
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    load_failures: int = 0
    validations_passed: int = 0
    validations_failed: int = 0
    queue_depth: int = 0
    deployment: str = "chat"

    def grow(self, requests: int, seconds: float, errors: int = 0) -> None:
        """``requests`` more answered in ``seconds`` each, ``errors`` of them server-side failures."""
        self.latencies += [seconds] * requests
        self.errors += errors

    def body(self) -> dict[str, Any]:
        """The heartbeat entry."""
        return {
            "deployment": self.deployment,
            "digest": self.digest,
            "requests": len(self.latencies),
            "errors": self.errors,
            "latency_le": latency_le(self.latencies) if self.latencies else [],
            "latency_sum": sum(self.latencies),
            "load_failures": self.load_failures,
            "validations_passed": self.validations_passed,
            "validations_failed": self.validations_failed,
            "queue_depth": self.queue_depth,
            "instances": 1,
        }


def heartbeat(
    client: httpx.Client,
    headers: dict[str, str],
    node_id: str,
    since: str,
    served: Sequence[Served],
    **report: Any,
) -> None:
    """POST a heartbeat whose ``serve`` holds ``served``'s counters, counted since ``since``."""
    body = {"serve": {"since": since, "versions": [s.body() for s in served]}, **report}
    response = client.post(f"/v1/nodes/{node_id}/heartbeat", json=body, headers=headers)
    assert response.status_code == 204, response.text
