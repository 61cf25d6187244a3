"""The ``status`` of a ``ModelRollout`` as people and ``kubectl`` read it: phase, step, weight, conditions.

The engine's own status is stored whole under ``status.engine`` (``RolloutStatus.to_dict``); the
fields beside it are derived for the printer columns (``kubectl get mro``) and for humans:

- ``phase`` — Progressing, Paused, Degraded, Healthy (the engine's), or ``Invalid`` when the
  spec or its version was refused (``status.message`` says why);
- ``step`` — ``2/5``; ``weight`` — the canary's share in percent; ``stable``/``canary`` — digests
  (``stableShort``/``canaryShort``: their first 12 hex digits, for the columns);
- ``conditions`` — ``SpecValid``, ``VersionResolved``, ``Progressing``, ``Paused``,
  ``Degraded``, ``Healthy``, each ``True``/``False`` with a reason and the time it last changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from controlplane.rollouts.phases import Phase
from controlplane.rollouts.status import RolloutStatus, StatusError

__all__ = ["conditions_for", "engine_status", "summary"]


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


def summary(status: RolloutStatus, pointer: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The derived, human-facing fields (see the module docstring)."""
    share = float(pointer.get("share") or 0.0)
    return {
        "phase": str(status.phase),
        "step": f"{min(status.step_index + (0 if status.completed else 1), steps)}/{steps}",
        "weight": round(share * 100) if pointer.get("canary") else 0,
        "stable": pointer.get("stable"),
        "canary": pointer.get("canary"),
        "stableShort": _short(pointer.get("stable")),
        "canaryShort": _short(pointer.get("canary")),
        "message": status.message,
    }


def conditions_for(
    stored: Mapping[str, Any],
    now: datetime,
    *,
    engine: RolloutStatus | None = None,
    refused: tuple[str, str] | None = None,
) -> list[dict[str, str]]:
    """The conditions, keeping each one's ``lastTransitionTime`` while its status does not change."""
    wanted: dict[str, tuple[bool, str, str]] = {}
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
    previous = {c.get("type"): c for c in stored.get("conditions") or [] if isinstance(c, Mapping)}
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
