"""Operator verbs: promote, promote --full, pause, resume, abort, retry — each a change of status.

As in Argo Rollouts, a verb does not act; it changes the facts in the status and the next
reconcile acts on them. Verbs never need the clock beyond the ``now`` they are given and never
enter a step themselves: moving ``step_index`` and clearing ``step_entered_at`` is enough, the
engine enters the new step on its next call. A verb that makes no sense in the rollout's state
raises :class:`VerbError` saying what state it is in and which verb fits instead.

- ``promote`` — go to the next step now: ends a pause step, accepts an Inconclusive analysis,
  skips a running analysis or a waiting setWeight/prefetch; also lifts a manual pause.
- ``promote_full`` — skip every remaining step, pause and analysis; make the version stable.
- ``pause`` / ``resume`` — hold and release progression. Analysis keeps measuring while paused
  (a Failed analysis still aborts); the progress deadline does not run.
- ``abort`` — traffic back to stable at once; Degraded until ``retry`` or a changed spec.
- ``retry`` — after an abort, start again from the first step as a new attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime

from controlplane.rollouts.spec import RolloutSpec
from controlplane.rollouts.status import RolloutStatus
from controlplane.rollouts.steps import AbortReason, abort, describe
from weightship.errors import ConflictError
from weightship.modelrollout import VERBS, RolloutVerb

__all__ = ["BY_NAME", "Verb", "VerbError", "abort_rollout", "find", "pause", "promote", "promote_full", "resume", "retry"]


class VerbError(ConflictError):
    """The verb does not apply to the rollout's current state; the message says what does."""


def _require_active(spec: RolloutSpec, status: RolloutStatus, verb: str) -> None:
    if status.revision != spec.fingerprint:
        raise VerbError(f"{verb}: the rollout spec changed and was not reconciled yet; try again in a moment")
    if status.completed:
        raise VerbError(
            f"{verb}: the rollout is complete ({status.version} is stable); use 'weightship rollback' to go back"
        )
    if status.abort:
        raise VerbError(f"{verb}: the rollout is aborted ({status.abort_reason}); use 'retry' to start it again")


def promote(spec: RolloutSpec, status: RolloutStatus, now: datetime) -> RolloutStatus:
    """Skip to the next step (lifting pauses); past the last step the version becomes stable."""
    _require_active(spec, status, "promote")
    if status.promote_full or status.step_index >= len(spec.steps):
        raise VerbError("promote: every step is done; the version is being made stable already")
    return replace(
        status,
        step_index=status.step_index + 1,
        step_entered_at=None,
        deadline_at=None,
        pause_conditions=(),
        paused=False,
        paused_at=None,
        message=f"promoted past {describe(spec, status.step_index)} at {now.isoformat()}",
    )


def promote_full(spec: RolloutSpec, status: RolloutStatus, now: datetime) -> RolloutStatus:
    """Skip all remaining steps, pauses and analysis, even while paused."""
    _require_active(spec, status, "promote --full")
    return replace(
        status,
        promote_full=True,
        promote_reason=f"promote --full at {now.isoformat()}",
        pause_conditions=(),
        paused=False,
        paused_at=None,
        deadline_at=None,
        message=f"promote --full at {now.isoformat()}",
    )


def pause(spec: RolloutSpec, status: RolloutStatus, now: datetime) -> RolloutStatus:
    """Hold the rollout at its current step until resumed (or promoted)."""
    _require_active(spec, status, "pause")
    if status.paused:
        raise VerbError("pause: the rollout is already paused; use 'resume' to continue")
    if status.promote_full or status.step_index >= len(spec.steps):
        raise VerbError("pause: every step is done; the version is being made stable already")
    return replace(status, paused=True, paused_at=now, message=f"paused by operator at {now.isoformat()}")


def resume(spec: RolloutSpec, status: RolloutStatus, now: datetime) -> RolloutStatus:
    """Lift a manual pause; the progress deadline moves forward by the time spent paused."""
    _require_active(spec, status, "resume")
    if not status.paused:
        if status.pause_conditions:
            reasons = ", ".join(p.reason for p in status.pause_conditions)
            raise VerbError(
                f"resume: the rollout is not paused by an operator but by {reasons}; use 'promote' to continue"
            )
        raise VerbError("resume: the rollout is not paused")
    deadline = status.deadline_at
    if deadline is not None and status.paused_at is not None:
        deadline += now - status.paused_at
    return replace(status, paused=False, paused_at=None, deadline_at=deadline, message=f"resumed at {now.isoformat()}")


def abort_rollout(spec: RolloutSpec, status: RolloutStatus, now: datetime, reason: str = "") -> RolloutStatus:
    """Send all traffic back to the stable version at once; Degraded until retried or respecified."""
    _require_active(spec, status, "abort")
    return abort(status, now, AbortReason.OPERATOR, reason or "aborted by an operator")


def retry(spec: RolloutSpec, status: RolloutStatus, now: datetime) -> RolloutStatus:
    """Start an aborted rollout again from its first step, as a new attempt."""
    if status.revision != spec.fingerprint:
        raise VerbError("retry: the rollout spec changed and was not reconciled yet; the new spec starts on its own")
    if not status.abort:
        raise VerbError(f"retry: the rollout is {status.phase}, not aborted; only an aborted rollout can be retried")
    return replace(
        status,
        attempt=status.attempt + 1,
        step_index=0,
        step_entered_at=None,
        deadline_at=None,
        pause_conditions=(),
        paused=False,
        paused_at=None,
        abort=False,
        aborted_at=None,
        abort_reason="",
        promote_full=False,
        promote_reason="",
        analysis_runs=(),
        message=f"retry (attempt {status.attempt + 1}) at {now.isoformat()}",
    )


#: what a verb does to a rollout's status
Verb = Callable[[RolloutSpec, RolloutStatus, datetime], RolloutStatus]

#: The one verb table, for the REST API and the operator alike.
BY_NAME: Mapping[RolloutVerb, Verb] = {
    "promote": promote,
    "promote-full": promote_full,
    "pause": pause,
    "resume": resume,
    "abort": abort_rollout,
    "retry": retry,
}
assert tuple(BY_NAME) == VERBS, "every verb of the contract has one function"


def find(name: str) -> Verb | None:
    """The verb spelled ``name``, or ``None``."""
    return _BY_SPELLING.get(name)


_BY_SPELLING: Mapping[str, Verb] = {str(name): verb for name, verb in BY_NAME.items()}
