"""Analysis arithmetic: measurements → metric results → the analysis run's result (Argo semantics).

Each measurement is judged on its own (:func:`judge_measurement`):

- the provider failed to measure (timeout, HTTP error) → **Error**;
- the provider answered with *no data*: ``None``, an empty list or mapping, or ``NaN`` anywhere in
  the value → the metric's ``noData`` policy, **Inconclusive** by default (``error`` and ``failed``
  may be chosen). No data is never a success: a canary that serves no traffic has proved nothing;
- otherwise the conditions decide: the failure condition true → **Failed**; with both conditions,
  the success condition true → **Successful**, neither → **Inconclusive**; with only a success
  condition, false → **Failed**; with only a failure condition, false → **Successful**;
- a condition that cannot be evaluated on this value (index out of range, a string where a number
  is needed) → **Error**.

The counters follow Argo exactly: Successful, Failed and Inconclusive add to ``count``; an Error
does not, it adds to ``consecutive_errors``, which any other measurement resets to 0.

A metric's result (:meth:`MetricRun.assess`), checked after every measurement:
``failed > failureLimit`` → **Failed**; ``consecutive_errors > consecutiveErrorLimit`` → **Error**;
``inconclusive > inconclusiveLimit`` → **Inconclusive**; else ``count >= count wanted`` →
**Successful**; else Running (Pending before the first measurement). Measurements are folded one at
a time and a metric stops at its first result, so two limits are never crossed at once (Argo's
"later check overwrites" order therefore never matters here).

A run's result (:func:`assess_run`): as soon as one metric ends Failed, Error or Inconclusive the run
ends with the *worst* metric result (Failed > Error > Inconclusive); the other metrics stop and stay
visibly Running/Pending — a stopped metric is never reported as Successful. The run is Successful
only when every metric is. The rollout continues on Successful, pauses on Inconclusive and aborts on
Failed or Error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from controlplane.rollouts.conditions import ConditionEvaluationError
from controlplane.rollouts.spec import MetricSpec

__all__ = [
    "ERROR_RETRY_SECONDS",
    "AnalysisPhase",
    "AnalysisRun",
    "Measurement",
    "MeasurementPhase",
    "MetricRun",
    "assess_run",
    "is_no_data",
    "judge_measurement",
    "worst",
]


#: Retry delay for a metric without ``interval`` whose measurement errored.
ERROR_RETRY_SECONDS = 10.0


class MeasurementPhase(StrEnum):
    """The verdict on one measurement."""

    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"


class AnalysisPhase(StrEnum):
    """The state of a metric or of a whole analysis run."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCESSFUL = "Successful"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"
    FAILED = "Failed"

    @property
    def completed(self) -> bool:
        """Whether this is a final result."""
        return self not in (AnalysisPhase.PENDING, AnalysisPhase.RUNNING)


#: Argo's order (``analysisStatusOrder``): the worst result wins across metrics.
_SEVERITY = {
    AnalysisPhase.SUCCESSFUL: 0,
    AnalysisPhase.RUNNING: 1,
    AnalysisPhase.PENDING: 2,
    AnalysisPhase.INCONCLUSIVE: 3,
    AnalysisPhase.ERROR: 4,
    AnalysisPhase.FAILED: 5,
}
_UNSUCCESSFUL = (AnalysisPhase.INCONCLUSIVE, AnalysisPhase.ERROR, AnalysisPhase.FAILED)


def worst(phases: Sequence[AnalysisPhase]) -> AnalysisPhase:
    """The worst of ``phases`` by Argo's order (Successful < Running < Pending < Inconclusive < Error < Failed)."""
    return max(phases, key=_SEVERITY.__getitem__, default=AnalysisPhase.SUCCESSFUL)


def is_no_data(value: object) -> bool:
    """True for a value that carries no measurement: None, empty, or NaN anywhere inside."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, Mapping):
        return not value or any(is_no_data(v) for v in value.values())
    if isinstance(value, Sequence) and not isinstance(value, str):
        return not value or any(is_no_data(v) for v in value)
    return False


def judge_measurement(metric: MetricSpec, value: object, error: str | None) -> tuple[MeasurementPhase, str]:
    """The verdict on one provider answer, and a message that says why."""
    if error is not None:
        return MeasurementPhase.ERROR, f"provider error: {error}"
    if is_no_data(value):
        phase = {
            "inconclusive": MeasurementPhase.INCONCLUSIVE,
            "error": MeasurementPhase.ERROR,
            "failed": MeasurementPhase.FAILED,
        }[metric.no_data]
        return phase, f"no data ({value!r}); noData policy {metric.no_data!r}"
    try:
        failed = metric.failure.evaluate(value) if metric.failure is not None else None
        succeeded = metric.success.evaluate(value) if metric.success is not None else None
    except ConditionEvaluationError as exc:
        return MeasurementPhase.ERROR, f"condition could not be evaluated: {exc.message}"
    if failed:
        return MeasurementPhase.FAILED, f"failureCondition {metric.failure.text!r} is true"  # type: ignore[union-attr]
    if succeeded is None:
        return MeasurementPhase.SUCCESSFUL, f"failureCondition {metric.failure.text!r} is false"  # type: ignore[union-attr]
    if succeeded:
        return MeasurementPhase.SUCCESSFUL, f"successCondition {metric.success.text!r} is true"  # type: ignore[union-attr]
    if failed is None:
        return MeasurementPhase.FAILED, f"successCondition {metric.success.text!r} is false"  # type: ignore[union-attr]
    return MeasurementPhase.INCONCLUSIVE, "neither successCondition nor failureCondition is true"


@dataclass(frozen=True)
class Measurement:
    """One recorded measurement: its verdict, when it was taken, and the (JSON-safe) value."""

    index: int
    phase: MeasurementPhase
    taken_at: datetime
    value: object
    message: str


@dataclass(frozen=True)
class MetricRun:
    """One metric inside a run: its measurements, Argo's counters and its current result."""

    name: str
    measurements: tuple[Measurement, ...] = ()
    count: int = 0
    successful: int = 0
    failed: int = 0
    inconclusive: int = 0
    errors: int = 0
    consecutive_errors: int = 0
    phase: AnalysisPhase = AnalysisPhase.PENDING
    message: str = ""

    def record(self, metric: MetricSpec, taken_at: datetime, value: object, error: str | None) -> MetricRun:
        """Fold one provider answer into the counters and reassess; a finished metric ignores it."""
        if self.phase.completed:
            return self
        phase, message = judge_measurement(metric, value, error)
        measurement = Measurement(len(self.measurements), phase, taken_at, _json_safe(value), message)
        counted = phase is not MeasurementPhase.ERROR
        updated = replace(
            self,
            measurements=(*self.measurements, measurement),
            count=self.count + counted,
            successful=self.successful + (phase is MeasurementPhase.SUCCESSFUL),
            failed=self.failed + (phase is MeasurementPhase.FAILED),
            inconclusive=self.inconclusive + (phase is MeasurementPhase.INCONCLUSIVE),
            errors=self.errors + (not counted),
            consecutive_errors=0 if counted else self.consecutive_errors + 1,
        )
        return updated.assess(metric)

    def assess(self, metric: MetricSpec) -> MetricRun:
        """Apply the limits (see the module docstring) and set :attr:`phase` and :attr:`message`."""
        if not self.measurements:
            return replace(self, phase=AnalysisPhase.PENDING, message="no measurement yet")
        checks = (
            (self.failed > metric.failure_limit, AnalysisPhase.FAILED,
             f"{self.failed} failed measurement(s), more than failureLimit {metric.failure_limit}"),
            (self.consecutive_errors > metric.consecutive_error_limit, AnalysisPhase.ERROR,
             f"{self.consecutive_errors} consecutive errors, more than consecutiveErrorLimit {metric.consecutive_error_limit}"),
            (self.inconclusive > metric.inconclusive_limit, AnalysisPhase.INCONCLUSIVE,
             f"{self.inconclusive} inconclusive measurement(s), more than inconclusiveLimit {metric.inconclusive_limit}"),
            (self.count >= metric.count, AnalysisPhase.SUCCESSFUL,
             f"{self.count} of {metric.count} measurements taken, {self.failed} failed, within limits"),
        )  # fmt: skip
        for crossed, phase, message in checks:
            if crossed:
                return replace(self, phase=phase, message=f"{phase}: {message}; last: {self.measurements[-1].message}")
        return replace(self, phase=AnalysisPhase.RUNNING, message=f"{self.count} of {metric.count} measurements taken")

    def next_due(self, metric: MetricSpec, run_started_at: datetime) -> datetime | None:
        """When the next measurement is due, or None when the metric has its result."""
        if self.phase.completed:
            return None
        if not self.measurements:
            return run_started_at + timedelta(seconds=metric.initial_delay_seconds)
        # Argo measures again one interval after the previous measurement, errors included; a
        # single-shot metric whose only measurement errored is retried after a short pause.
        return self.measurements[-1].taken_at + timedelta(seconds=metric.interval_seconds or ERROR_RETRY_SECONDS)


@dataclass(frozen=True)
class AnalysisRun:
    """The analysis of one step in one attempt; ``run_id`` names it to providers and in storage."""

    run_id: str
    step_index: int
    started_at: datetime
    metrics: tuple[MetricRun, ...]
    phase: AnalysisPhase = AnalysisPhase.RUNNING
    message: str = ""

    @classmethod
    def start(cls, run_id: str, step_index: int, metrics: Sequence[MetricSpec], now: datetime) -> AnalysisRun:
        """A new run with every metric Pending."""
        return cls(run_id, step_index, now, tuple(MetricRun(m.name) for m in metrics), AnalysisPhase.RUNNING)

    def record(
        self, metrics: Sequence[MetricSpec], name: str, index: int, taken_at: datetime, value: object, error: str | None
    ) -> AnalysisRun:
        """Fold measurement ``index`` of metric ``name``; anything but the next expected one is ignored.

        Ignoring repeats is what makes re-running the engine on the same observations harmless.
        """
        if self.phase.completed:
            return self
        runs = list(self.metrics)
        for position, (spec, run) in enumerate(zip(metrics, runs, strict=True)):
            if spec.name == name and index == len(run.measurements):
                runs[position] = run.record(spec, taken_at, value, error)
        if runs == list(self.metrics):
            return self
        phase, message = assess_run(runs)
        return replace(self, metrics=tuple(runs), phase=phase, message=message)


def assess_run(metrics: Sequence[MetricRun]) -> tuple[AnalysisPhase, str]:
    """The run's result: the worst unsuccessful metric ends it; Successful once all are."""
    ended = [m for m in metrics if m.phase in _UNSUCCESSFUL]
    if ended:
        culprit = max(ended, key=lambda m: _SEVERITY[m.phase])
        return culprit.phase, f"metric {culprit.name!r} {culprit.message}"
    if all(m.phase is AnalysisPhase.SUCCESSFUL for m in metrics):
        return AnalysisPhase.SUCCESSFUL, f"all {len(metrics)} metric(s) successful"
    return AnalysisPhase.RUNNING, ", ".join(f"{m.name}: {m.message}" for m in metrics)


def _json_safe(value: object) -> object:
    """The value as stored in status: non-finite floats become strings so any JSON store accepts them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_json_safe(v) for v in value]
    return value
