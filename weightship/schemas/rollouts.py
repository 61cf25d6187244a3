"""Rollouts: create, read, act on them, and the builtin analysis measurements."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from weightship.modelrollout import RolloutVerb
from weightship.schemas.base import Count, Digest, Name, Schema

__all__ = [
    "BuiltinMeasure",
    "BuiltinMeasurement",
    "NodeLoads",
    "Rollout",
    "RolloutAction",
    "RolloutAnalysisRun",
    "RolloutCreate",
    "RolloutList",
    "RolloutMeasurement",
    "RolloutMetric",
    "RolloutStep",
    "VersionLoads",
]

class BuiltinMeasure(Schema):
    """``POST /v1/deployments/{name}/analysis/builtin``: one built-in measurement, canary against stable, by digest.

    For a rollout driven outside the control plane (the Kubernetes operator): the control plane
    measures from the serving counters it holds (``docs/rollouts.md``, provider ``builtin``).
    """

    metric: str = Field(description="the analysis metric's name (messages name it)")
    provider: dict[str, Any] = Field(description="the metric's builtin settings: metric, minRequests, window, timeout")
    canary: Digest
    stable: Digest | None = None


class BuiltinMeasurement(Schema):
    """The answer: the measured ``value`` (a mapping, see ``docs/rollouts.md``), or null when there is no data."""

    value: dict[str, float] | None = None


class NodeLoads(Schema):
    """How one node's model servers fared loading a version of a deployment (their summed counters)."""

    node: Name
    loaded: bool = Field(description="a load passed validation, or a request was answered with the version")
    failures: Count = Field(description="loads that failed or failed validation (golden check, NaN scan)")


class VersionLoads(Schema):
    """``GET /v1/deployments/{name}/analysis/loads?digest=``: the loads of ``digest`` on every live node reporting it.

    For a rollout driven outside the control plane (the Kubernetes operator): a canary whose model
    servers keep refusing it never serves, so the rollout aborts at once. Counters are cumulative
    per agent; a reader keeps its own baseline to count only the failures of its attempt.
    """

    digest: Digest
    nodes: list[NodeLoads] = Field(default_factory=list)



class RolloutCreate(Schema):
    """``POST /v1/deployments/{name}/rollouts``: the engine spec (``version``, ``steps``, ...; see docs/rollouts.md).

    ``spec.version`` may be a label or a ``sha256:`` digest of a ready version of the deployment's model.
    """

    spec: dict[str, Any]


class RolloutStep(Schema):
    """One step of a rollout, as ``status`` shows it."""

    index: int
    kind: Literal["setWeight", "pause", "analysis", "prefetch"]
    summary: str
    state: Literal["done", "current", "pending"]


class RolloutMeasurement(Schema):
    """One measurement of one metric: its verdict and the provider's value (or why there is none)."""

    index: int
    phase: str
    value: Any = None
    started_at: datetime
    finished_at: datetime | None = None
    message: str = ""


class RolloutMetric(Schema):
    """One metric of an analysis run with every measurement taken."""

    name: str
    phase: str
    measurements: list[RolloutMeasurement]


class RolloutAnalysisRun(Schema):
    """The analysis of one step: ``Running``, then ``Successful``, ``Failed``, ``Inconclusive`` or ``Error``."""

    id: str
    step_index: int
    phase: str
    metrics: list[RolloutMetric]


class Rollout(Schema):
    """A rollout of one version of a deployment, with where it is and what it measured.

    ``weight`` is the canary percent now (0-100); ``nodes`` counts the target nodes serving each
    digest; ``staged_nodes`` hold ``version`` verified on disk; ``status`` is the engine's stored
    status (schema 1), ``spec`` the spec as created (``version`` resolved to a digest).
    """

    id: str
    deployment: Name
    model: Name
    version: Digest
    stable: Digest | None
    phase: Literal["Progressing", "Paused", "Degraded", "Healthy"]
    message: str
    completed: bool
    aborted: bool
    step_index: int
    steps_total: int
    steps: list[RolloutStep]
    weight: float
    attempt: int
    analysis_runs: list[RolloutAnalysisRun]
    nodes: dict[str, int]
    staged_nodes: int
    target_nodes: int
    spec: dict[str, Any]
    status: dict[str, Any]
    created_at: datetime
    created_by: str
    updated_at: datetime


class RolloutList(Schema):
    """Rollouts, newest first."""

    rollouts: list[Rollout]


class RolloutAction(Schema):
    """``POST .../rollouts/{id}/actions``: a verb; the next reconcile acts on it."""

    verb: RolloutVerb
