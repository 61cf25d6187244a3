"""Steps: entering a step, and judging whether it is done, one step kind at a time.

Entering a step records its start (and, by kind, arms the progress deadline, adds a pause
condition, or starts an analysis run) so that after a restart the step continues where it was
instead of starting over. Judging a step only reads the status and the observations:

- ``setWeight N`` — done when the observed pointer names the canary at N % and every node the driver
  assigned to the canary reports serving it (weights loaded and verified);
- ``pause`` — done when its duration has passed since it was entered; without a duration only
  ``promote`` ends it;
- ``prefetch P`` — done when at least P % of the target nodes hold the canary verified on disk;
  until then no traffic moves (the step holds the pointer at the previous weight, 0 % before any
  ``setWeight``). Nodes that cannot stage (disk full) are named in the message;
- ``analysis`` — folds new measurements into the step's run; done when the run is Successful; asks
  for the measurements that are due; an Inconclusive run pauses, a Failed or Error run aborts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from controlplane.rollouts.actions import Action, MeasureMetric
from controlplane.rollouts.analysis import AnalysisPhase, AnalysisRun
from controlplane.rollouts.deadline import progress_deadline
from controlplane.rollouts.observations import Observations
from controlplane.rollouts.spec import AnalysisStep, PauseStep, PrefetchStep, RolloutSpec, SetWeightStep
from controlplane.rollouts.status import PauseCondition, PauseReason, RolloutStatus

__all__ = ["AbortReason", "StepOutcome", "abort", "describe", "enter_step", "judge_step", "run_id", "weight_at"]

#: Shares are compared with a tolerance: they travel as floats through JSON and SQL.
SHARE_TOLERANCE = 1e-6


class AbortReason:
    """Why a rollout was aborted (``status.abort_reason``)."""

    OPERATOR = "AbortedByOperator"
    ANALYSIS_FAILED = "AnalysisFailed"
    ANALYSIS_ERROR = "AnalysisError"
    PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
    CANARY_REFUSED = "CanaryRefused"
    POINTER_CHANGED = "PointerChangedExternally"


@dataclass(frozen=True)
class StepOutcome:
    """The judgement of the current step: done or not, the updated status, what is still needed."""

    done: bool
    status: RolloutStatus
    actions: tuple[Action, ...] = ()
    message: str = ""


def describe(spec: RolloutSpec, index: int) -> str:
    """A short human name for step ``index``: ``step 2/6 (setWeight 25)``."""
    step = spec.steps[index]
    match step:
        case SetWeightStep(weight=weight):
            detail = f"setWeight {weight}"
        case PauseStep(duration_seconds=None):
            detail = "pause until promoted"
        case PauseStep(duration_seconds=seconds):
            detail = f"pause {seconds:g}s"
        case PrefetchStep(percent=percent):
            detail = f"prefetch {percent}%"
        case AnalysisStep(metrics=metrics):
            detail = f"analysis {', '.join(m.name for m in metrics)}"
    return f"step {index + 1}/{len(spec.steps)} ({detail})"


def run_id(status: RolloutStatus, step_index: int) -> str:
    """Deterministic analysis run id: the same step of the same attempt always has the same id."""
    return f"{status.revision}-a{status.attempt}-s{step_index}"


def weight_at(spec: RolloutSpec, step_index: int) -> int:
    """The canary weight wanted while at ``step_index``: the last setWeight up to and including it."""
    weights = [s.weight for s in spec.steps[: step_index + 1] if isinstance(s, SetWeightStep)]
    return weights[-1] if weights else 0


def enter_step(spec: RolloutSpec, status: RolloutStatus, observations: Observations, now: datetime) -> RolloutStatus:
    """Record that the current step starts at ``now``, with what that kind of step needs."""
    step = spec.steps[status.step_index]
    entered = replace(status, step_entered_at=now, deadline_at=None)
    if isinstance(step, SetWeightStep | PrefetchStep):
        deadline = progress_deadline(
            spec.progress_deadline_seconds, observations.version_bytes, observations.fetch_rate_bytes_per_s
        )
        return replace(entered, deadline_at=now + timedelta(seconds=deadline.seconds))
    if isinstance(step, PauseStep):
        return replace(
            entered, pause_conditions=(*status.pause_conditions, PauseCondition(PauseReason.PAUSE_STEP, now))
        )
    run = AnalysisRun.start(run_id(status, status.step_index), status.step_index, step.metrics, now)
    return entered.with_run(run)


def judge_step(spec: RolloutSpec, status: RolloutStatus, observations: Observations, now: datetime) -> StepOutcome:
    """Whether the current (already entered) step is done, and what it still needs."""
    step = spec.steps[status.step_index]
    name = describe(spec, status.step_index)
    if isinstance(step, SetWeightStep):
        return _judge_weight(spec, step, status, observations, name)
    if isinstance(step, PauseStep):
        return _judge_pause(step, status, now, name)
    if isinstance(step, PrefetchStep):
        return _judge_prefetch(step, status, observations, name)
    return _judge_analysis(step, status, observations, now, name)


def _judge_weight(
    spec: RolloutSpec, step: SetWeightStep, status: RolloutStatus, observations: Observations, name: str
) -> StepOutcome:
    pointer, fleet = observations.pointer, observations.fleet
    if pointer.canary != spec.version or abs(pointer.canary_share - step.weight / 100) > SHARE_TOLERANCE:
        return StepOutcome(
            False, status, message=f"{name}: waiting for the pointer (canary share now {pointer.canary_share:.0%})"
        )
    if fleet.canary_serving < fleet.canary_assigned:
        return StepOutcome(
            False,
            status,
            message=f"{name}: {fleet.canary_serving}/{fleet.canary_assigned} canary nodes serving the new version",
        )
    return StepOutcome(True, status, message=f"{name}: {fleet.canary_serving} canary node(s) serving")


def _judge_pause(step: PauseStep, status: RolloutStatus, now: datetime, name: str) -> StepOutcome:
    if step.duration_seconds is None:
        return StepOutcome(False, status, message=f"{name}: paused until promoted")
    assert status.step_entered_at is not None  # entered before judged
    ends = status.step_entered_at + timedelta(seconds=step.duration_seconds)
    if now >= ends:
        return StepOutcome(True, status, message=f"{name}: pause over")
    return StepOutcome(False, status, message=f"{name}: {(ends - now).total_seconds():.0f}s left")


def _judge_prefetch(step: PrefetchStep, status: RolloutStatus, observations: Observations, name: str) -> StepOutcome:
    fleet = observations.fleet
    # Integer arithmetic: "75 % of 4 nodes" must not depend on float rounding.
    done = fleet.target_nodes > 0 and fleet.staged_nodes * 100 >= step.percent * fleet.target_nodes
    message = f"{name}: {fleet.staged_nodes}/{fleet.target_nodes} target nodes staged and verified"
    if fleet.target_nodes == 0:
        message = f"{name}: no target nodes; nothing can be staged"
    if fleet.stage_failures and not done:
        shown = "; ".join(fleet.stage_failures[:3])
        more = f" (+{len(fleet.stage_failures) - 3} more)" if len(fleet.stage_failures) > 3 else ""
        message += f"; cannot stage on {len(fleet.stage_failures)} node(s): {shown}{more}"
    return StepOutcome(done, status, message=message if done else f"{message}; no traffic moves until {step.percent}%")


def _judge_analysis(
    step: AnalysisStep, status: RolloutStatus, observations: Observations, now: datetime, name: str
) -> StepOutcome:
    run = status.run_for_step(status.step_index)
    assert run is not None  # entered before judged
    for result in sorted(observations.measurements, key=lambda m: (m.metric, m.index)):
        if result.run_id == run.run_id:
            run = run.record(step.metrics, result.metric, result.index, result.taken_at, result.value, result.error)
    status = status.with_run(run)
    message = f"{name}: {run.phase}: {run.message}"
    if run.phase is AnalysisPhase.SUCCESSFUL:
        return StepOutcome(True, status, message=message)
    if run.phase in (AnalysisPhase.FAILED, AnalysisPhase.ERROR):
        reason = AbortReason.ANALYSIS_FAILED if run.phase is AnalysisPhase.FAILED else AbortReason.ANALYSIS_ERROR
        return StepOutcome(False, abort(status, now, reason, message), message=message)
    if run.phase is AnalysisPhase.INCONCLUSIVE:
        if not any(p.reason == PauseReason.INCONCLUSIVE_ANALYSIS for p in status.pause_conditions):
            pause = PauseCondition(PauseReason.INCONCLUSIVE_ANALYSIS, now)
            status = replace(status, pause_conditions=(*status.pause_conditions, pause))
        return StepOutcome(False, status, message=f"{message}; promote to accept or abort to roll back")
    wanted: list[Action] = []
    for metric, metric_run in zip(step.metrics, run.metrics, strict=True):
        due = metric_run.next_due(metric, run.started_at)
        if due is not None and now >= due:
            index = len(metric_run.measurements)
            wanted.append(
                MeasureMetric(
                    run.run_id, metric.name, index, metric.provider_kind, metric.provider, step_started_at=run.started_at
                )
            )
    return StepOutcome(False, status, tuple(wanted), message)


def abort(status: RolloutStatus, now: datetime, reason: str, message: str) -> RolloutStatus:
    """The facts of an abort: traffic goes back to stable; Degraded until retry or a new spec."""
    return replace(
        status,
        abort=True,
        aborted_at=now,
        abort_reason=reason,
        message=f"{reason}: {message}",
        pause_conditions=(),
        paused=False,
        paused_at=None,
        deadline_at=None,
    )
