"""The ``status`` of a ``ModelRollout`` as people and ``kubectl`` read it: phase, step, weight, conditions.

The engine's own status is stored whole under ``status.engine`` (``RolloutStatus.to_dict``); the
fields beside it are derived for the printer columns (``kubectl get mro``) and for humans:

- ``phase`` — Progressing, Paused, Degraded, Healthy (the engine's), or ``Invalid`` when the
  spec or its version was refused (``status.message`` says why). ``Healthy`` also needs the pods:
  while the engine is done but fewer pods are ready than wanted (or a template roll is under way)
  the phase stays ``Progressing``;
- ``step`` — ``2/5``; ``weight`` — the canary's share in percent; ``stable``/``canary`` — digests
  (``stableShort``/``canaryShort``: their first 12 hex digits; ``stableLabel``/``canaryLabel``:
  a label of each, ``v2``, for the columns);
- ``replicas``/``readyReplicas`` — pods of the stable and canary versions (all of them, and the
  ready ones), ``selector`` — the label selector of those pods: the ``scale`` subresource reads
  them, so an HPA or KEDA can scale a ModelRollout like a Deployment;
- ``conditions`` — ``SpecValid``, ``VersionResolved``, ``Progressing``, ``Paused``,
  ``Degraded``, ``Healthy``, ``Reconciled`` (False when the Kubernetes API or the control plane
  refused or could not be reached, with the reason), and ``PointerMovedOutside`` (True when the
  control plane's pointer was last moved outside this rollout, e.g. ``weightship rollback``),
  each ``True``/``False`` with a reason and the time it last changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.rollouts.phases import Phase
from controlplane.rollouts.status import RolloutStatus, StatusError

__all__ = ["Failure", "PodCount", "conditions_for", "engine_status", "summary"]


@dataclass(frozen=True)
class PodCount:
    """The pods of the versions the pointer names: wanted, existing, ready, and whether a template roll is on."""

    desired: int
    replicas: int
    ready: int
    rolling: bool = False

    @property
    def all_ready(self) -> bool:
        """Every wanted pod is ready, on the current template."""
        return self.ready >= self.desired and not self.rolling


@dataclass(frozen=True)
class Failure:
    """Why the last reconcile could not finish: a one-word reason (``Forbidden``, ``ControlPlaneUnreachable``)."""

    reason: str
    message: str


def engine_status(stored: Mapping[str, Any]) -> RolloutStatus | None:
    """The engine's status stored in the resource, or None (not started, or unreadable: start over)."""
    data = stored.get("engine")
    if not data:
        return None
    try:
        return RolloutStatus.from_dict(data)
    except StatusError:
        return None


def _short(digest: object) -> str | None:
    return digest.removeprefix("sha256:")[:12] if isinstance(digest, str) else None


def summary(
    status: RolloutStatus,
    pointer: Mapping[str, Any],
    steps: int,
    pods: PodCount | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The derived, human-facing fields (see the module docstring)."""
    share = float(pointer.get("share") or 0.0)
    phase = str(status.phase)
    message = status.message
    if status.phase is Phase.HEALTHY and pods is not None and not pods.all_ready:
        phase, message = str(Phase.PROGRESSING), f"{status.message}; {_waiting(pods)}"
    names = labels or {}
    out = {
        "phase": phase,
        "step": f"{min(status.step_index + (0 if status.completed else 1), steps)}/{steps}",
        "weight": round(share * 100) if pointer.get("canary") else 0,
        "stable": pointer.get("stable"),
        "canary": pointer.get("canary"),
        "stableShort": _short(pointer.get("stable")),
        "canaryShort": _short(pointer.get("canary")),
        "stableLabel": _label(pointer.get("stable"), names),
        "canaryLabel": _label(pointer.get("canary"), names),
        "message": message,
    }
    if pods is not None:
        out.update(replicas=pods.replicas, readyReplicas=pods.ready)
    return out


def _label(digest: object, labels: Mapping[str, str]) -> str | None:
    if not isinstance(digest, str):
        return None
    return labels.get(digest) or _short(digest)


def _waiting(pods: PodCount) -> str:
    if pods.rolling:
        return f"rolling the pods to the new template: {pods.ready} of {pods.desired} ready"
    return f"waiting for pods: {pods.ready} of {pods.desired} ready"


def conditions_for(
    stored: Mapping[str, Any],
    now: datetime,
    *,
    engine: RolloutStatus | None = None,
    refused: tuple[str, str] | None = None,
    pods: PodCount | None = None,
    failure: Failure | None = None,
    outside: Mapping[str, Any] | None = None,
) -> list[dict[str, str]]:
    """The conditions, keeping each one's ``lastTransitionTime`` while its status does not change.

    ``failure`` sets ``Reconciled`` False (else it is True: this reconcile got through); given
    alone (the reconcile stopped early), the other conditions are kept as stored.
    """
    previous = {c.get("type"): c for c in stored.get("conditions") or [] if isinstance(c, Mapping)}
    wanted: dict[str, tuple[bool, str, str]] = {}
    if failure is not None and engine is None and refused is None:
        kept = {
            str(kind): (c.get("status") == "True", str(c.get("reason") or ""), str(c.get("message") or ""))
            for kind, c in previous.items()
            if kind != "Reconciled"
        }
        wanted.update(kept)
        wanted["Reconciled"] = (False, failure.reason, failure.message)
        return _conditions(wanted, previous, now)
    if failure is not None:
        wanted["Reconciled"] = (False, failure.reason, failure.message)
    else:
        wanted["Reconciled"] = (True, "Reconciled", "the last reconcile got through")
    if refused is not None:
        reason, message = refused
        wanted["VersionResolved"] = (reason != "UnknownVersion", reason, message)
        wanted["SpecValid"] = (reason != "InvalidSpec", reason, message)
        wanted["Progressing"] = (False, reason, message)
    if engine is not None:
        phase = engine.phase
        wanted["SpecValid"] = (True, "Valid", "the spec was accepted")
        wanted["VersionResolved"] = (True, "Resolved", f"version {engine.version}")
        wanted["Progressing"] = (phase is Phase.PROGRESSING, str(phase), engine.message)
        wanted["Paused"] = (phase is Phase.PAUSED, str(phase), engine.message)
        wanted["Degraded"] = (phase is Phase.DEGRADED, engine.abort_reason or str(phase), engine.message)
        wanted["Healthy"] = (phase is Phase.HEALTHY, str(phase), engine.message)
        if phase is Phase.HEALTHY and pods is not None and not pods.all_ready:
            reason = "TemplateRolling" if pods.rolling else "PodsNotReady"
            wanted["Progressing"] = (True, reason, _waiting(pods))
            wanted["Healthy"] = (False, reason, _waiting(pods))
    if outside:
        why = "RolledBackOutside" if outside.get("action") == "rollback" else "PointerMovedOutside"
        wanted["PointerMovedOutside"] = (True, why, str(outside.get("message") or ""))
    elif engine is not None:
        wanted["PointerMovedOutside"] = (False, "Owned", "the control plane's pointer is as this rollout set it")
    return _conditions(wanted, previous, now)


def _conditions(
    wanted: Mapping[str, tuple[bool, str, str]], previous: Mapping[Any, Mapping[str, Any]], now: datetime
) -> list[dict[str, str]]:
    out = []
    for kind, (true, reason, message) in wanted.items():
        value = "True" if true else "False"
        before = previous.get(kind) or {}
        since = before.get("lastTransitionTime") if before.get("status") == value else None
        out.append(
            {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message[:1000],
                "lastTransitionTime": since or now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        )
    return out
