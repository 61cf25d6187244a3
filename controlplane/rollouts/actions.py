"""Actions: what the engine wants done, as idempotent descriptions a driver carries out.

The engine returns the actions that are *still needed* given what it observed: a ``SetPointer`` is
returned only while the observed pointer differs from the wanted one, and carries the epoch it was
computed against so the driver's compare-and-swap refuses it if the pointer moved meanwhile. A
``MeasureMetric`` names one measurement by (run, metric, index); asking twice for the same one is
the same request. Executing an action twice is therefore harmless, and losing one only costs a
reconcile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["Action", "MeasureMetric", "SetPointer", "StageVersion"]


@dataclass(frozen=True)
class SetPointer:
    """Write the deployment's pointer (CAS on ``expected_epoch``); ``reason`` goes to the audit row."""

    stable: str
    canary: str | None
    canary_share: float
    reason: str
    expected_epoch: int


@dataclass(frozen=True)
class StageVersion:
    """Have ``share`` of the target nodes fetch and verify ``version`` without serving it."""

    version: str
    share: float


@dataclass(frozen=True)
class MeasureMetric:
    """Take measurement ``index`` of ``metric`` for analysis run ``run_id`` and report it back.

    ``step_started_at`` is when the analysis step began (the canary was serving at its weight by
    then): a provider windows its query to it (``{{window}}`` in PromQL), so what happened before
    the step, such as errors while the canary was still loading, never counts against it.
    """

    run_id: str
    metric: str
    index: int
    provider_kind: str
    provider: Mapping[str, Any] = field(default_factory=dict, compare=False)
    step_started_at: datetime | None = field(default=None, compare=False)


Action = SetPointer | StageVersion | MeasureMetric
