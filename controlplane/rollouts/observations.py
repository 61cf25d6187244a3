"""Observations: what a driver saw of the world, handed to the engine on every reconcile.

The engine never looks anything up. A driver (fleet or Kubernetes) reads the deployment's pointer,
counts target nodes and what they hold, reports the version's size and the fleet's measured fetch
rate, and passes back the provider answers to measurements the engine asked for. Everything here is
a snapshot; the engine is level-triggered, so a stale snapshot only delays it, never misleads it
into acting twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = ["FleetObservation", "MeasurementResult", "Observations", "PointerObservation"]


@dataclass(frozen=True)
class PointerObservation:
    """The deployment's serving pointer as last read, with its epoch for compare-and-swap."""

    stable: str | None
    canary: str | None
    canary_share: float
    epoch: int


@dataclass(frozen=True)
class FleetObservation:
    """How the target nodes stand for the version being rolled out.

    ``staged_nodes`` hold the canary verified on disk (from bytes they hashed themselves);
    ``canary_assigned`` are the nodes the driver put on the canary side for the current pointer and
    ``canary_serving`` those of them that report serving it (weights loaded and verified).
    ``stage_failures`` are short per-node reasons why staging cannot finish (``node-3: disk full``).
    ``canary_refused`` names the canary nodes whose model servers refused the canary (its load or
    validation failed): such a canary never becomes ready, and the rollout aborts at once.
    """

    target_nodes: int
    staged_nodes: int = 0
    canary_assigned: int = 0
    canary_serving: int = 0
    stage_failures: tuple[str, ...] = ()
    canary_refused: tuple[str, ...] = ()


@dataclass(frozen=True)
class MeasurementResult:
    """A provider's answer to ``MeasureMetric(run_id, metric, index)``: a value, or an error text."""

    run_id: str
    metric: str
    index: int
    taken_at: datetime
    value: object = None
    error: str | None = None


@dataclass(frozen=True)
class Observations:
    """Everything the engine may know about the world for one reconcile.

    ``version_bytes`` is the total size of the canary version; ``fetch_rate_bytes_per_s`` is the
    per-node fetch throughput the fleet measured recently (None when nothing was measured yet).
    Both size the default progress deadline.
    """

    pointer: PointerObservation
    fleet: FleetObservation
    version_bytes: int
    fetch_rate_bytes_per_s: float | None = None
    measurements: tuple[MeasurementResult, ...] = ()
