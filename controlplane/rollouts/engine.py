"""The rollout engine: a pure function from (spec, status, observations, now) to (actions, status).

No I/O, no clock, no randomness: the caller passes ``now``. Calling :func:`reconcile` twice with
the same inputs gives the same result, and calling it again with the status it returned and the
same observations asks for the same still-needed actions without counting anything twice. That is
what lets a driver call it on every tick, and lets a restarted control plane resume a rollout from
the stored status alone.

One reconcile:

1. **Start or restart.** No status, or a status of another spec (its ``revision`` differs), starts
   the rollout afresh at step 1, capturing the pointer's current stable version as the rollback
   target. With no stable version at all (first deploy) or when the version already is stable,
   the steps are skipped and the version is simply made stable, as Argo does on an initial deploy.
2. **Ownership.** If the pointer's stable version is neither the captured one nor the new one,
   somebody else moved it; the rollout aborts without touching the pointer again. If somebody made
   the new version stable by hand, the rollout is complete.
3. **Aborted.** Want ``stable, no canary, 0 %`` at once; nothing else happens until ``retry`` or a
   changed spec.
4. **Finishing.** After the last step, or with ``promote --full``, want ``version`` as stable with
   no canary; once that is observed the rollout is complete (Healthy) and never acts again.
5. **Steps.** Enter the current step if needed, judge it, and advance while steps are done (unless
   manually paused); several steps may pass in one reconcile when observations allow. A step that
   waits on the fleet past its deadline aborts the rollout, so a canary that never becomes ready
   ends Degraded, never paused for ever. Once traffic moved, a canary node whose model servers
   refused the version (load or validation failed) aborts the rollout at once. Then want
   ``stable, version, weight %`` where weight is the last ``setWeight`` reached, and keep the canary
   staged on the share the prefetch steps ask for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from controlplane.rollouts.actions import Action, SetPointer, StageVersion
from controlplane.rollouts.observations import Observations
from controlplane.rollouts.spec import PrefetchStep, RolloutSpec, SetWeightStep
from controlplane.rollouts.status import RolloutStatus
from controlplane.rollouts.steps import SHARE_TOLERANCE, AbortReason, abort, describe, enter_step, judge_step, weight_at

__all__ = ["Reconciliation", "reconcile"]


@dataclass(frozen=True)
class Reconciliation:
    """What one reconcile decided: the actions still needed and the status to store."""

    actions: tuple[Action, ...]
    status: RolloutStatus


def reconcile(
    spec: RolloutSpec, status: RolloutStatus | None, observations: Observations, now: datetime
) -> Reconciliation:
    """Decide the next actions and the new status; see the module docstring for the rules."""
    if now.tzinfo is None:
        raise ValueError("reconcile: 'now' must be timezone-aware (e.g. datetime.now(UTC))")
    if status is None or status.revision != spec.fingerprint:
        status = _start(spec, observations, now)
    if status.completed:
        return Reconciliation((), status)
    observed_stable = observations.pointer.stable
    finishing = status.promote_full or status.step_index >= len(spec.steps)
    if not status.abort and not finishing and observed_stable == spec.version:
        message = "the version was made stable outside this rollout; nothing left to do"
        return Reconciliation((), replace(status, completed=True, pause_conditions=(), paused=False, message=message))
    if not status.abort and observed_stable not in (status.stable, spec.version):
        status = abort(
            status,
            now,
            AbortReason.POINTER_CHANGED,
            f"the pointer's stable version became {observed_stable} outside this rollout; it is left as it is",
        )
    if status.abort:
        return _aborted(status, observations)
    if finishing:
        return _finish(spec, status, observations)
    return _progress(spec, status, observations, now)


def _start(spec: RolloutSpec, observations: Observations, now: datetime) -> RolloutStatus:
    stable = observations.pointer.stable
    status = RolloutStatus(revision=spec.fingerprint, version=spec.version, stable=stable, attempt=1)
    if stable is None:
        reason = "first deploy: no stable version to compare with; steps skipped"
        return replace(status, promote_full=True, promote_reason=reason, message=reason)
    if stable == spec.version:
        reason = "the version is already stable; steps skipped"
        return replace(status, promote_full=True, promote_reason=reason, message=reason)
    return replace(status, message=f"started at {now.isoformat()}")


def _pointer_action(
    observations: Observations, stable: str, canary: str | None, share: float, reason: str
) -> tuple[Action, ...]:
    pointer = observations.pointer
    if pointer.stable == stable and pointer.canary == canary and abs(pointer.canary_share - share) <= SHARE_TOLERANCE:
        return ()
    return (SetPointer(stable, canary, share, reason, pointer.epoch),)


def _aborted(status: RolloutStatus, observations: Observations) -> Reconciliation:
    if status.stable is None or observations.pointer.stable not in (status.stable, status.version):
        return Reconciliation((), status)  # not ours to move back (see ownership above)
    reason = f"rollout aborted: {status.message}"
    return Reconciliation(_pointer_action(observations, status.stable, None, 0.0, reason), status)


def _finish(spec: RolloutSpec, status: RolloutStatus, observations: Observations) -> Reconciliation:
    why = status.promote_reason if status.promote_full else f"all {len(spec.steps)} steps complete"
    actions = _pointer_action(observations, spec.version, None, 0.0, f"rollout promoted: {why}")
    if actions:
        return Reconciliation(actions, replace(status, message=f"promoting ({why}): waiting for the pointer"))
    return Reconciliation((), replace(status, completed=True, message=f"promoted ({why}); {spec.version} is stable"))


def _progress(spec: RolloutSpec, status: RolloutStatus, observations: Observations, now: datetime) -> Reconciliation:
    step_actions: tuple[Action, ...] = ()
    while status.step_index < len(spec.steps):
        if status.step_entered_at is None:
            status = enter_step(spec, status, observations, now)
        refused = observations.fleet.canary_refused
        if refused and weight_at(spec, status.step_index) > 0:
            shown = "; ".join(refused[:3]) + (f" (+{len(refused) - 3} more)" if len(refused) > 3 else "")
            message = f"{describe(spec, status.step_index)}: the canary cannot serve on {len(refused)} node(s): {shown}"
            return _aborted(abort(status, now, AbortReason.CANARY_REFUSED, message), observations)
        outcome = judge_step(spec, status, observations, now)
        status, step_actions = outcome.status, outcome.actions
        if status.abort:
            return _aborted(status, observations)
        if outcome.done and not status.paused:
            status = replace(
                status,
                step_index=status.step_index + 1,
                step_entered_at=None,
                deadline_at=None,
                pause_conditions=(),
                message=outcome.message,
            )
            continue
        status = replace(status, message=outcome.message + (" (manually paused)" if status.paused else ""))
        step = spec.steps[status.step_index]
        waits_on_fleet = isinstance(step, SetWeightStep | PrefetchStep)
        if (
            waits_on_fleet
            and not outcome.done
            and not status.paused
            and status.deadline_at
            and now >= status.deadline_at
        ):
            message = f"{describe(spec, status.step_index)} made no progress before its deadline; {outcome.message}"
            return _aborted(abort(status, now, AbortReason.PROGRESS_DEADLINE, message), observations)
        break
    if status.step_index >= len(spec.steps):
        return _finish(spec, status, observations)
    assert status.stable is not None  # a rollout with steps always has a stable version (see _start)
    weight = weight_at(spec, status.step_index)
    reason = f"rollout {describe(spec, status.step_index)}: canary {weight}%"
    actions = _pointer_action(observations, status.stable, spec.version, weight / 100, reason)
    if spec.prefetch_percent:
        actions += (StageVersion(spec.version, spec.prefetch_percent / 100),)
    return Reconciliation(actions + step_actions, status)
