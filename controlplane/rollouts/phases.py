"""Rollout phases, computed from status with Argo Rollouts' precedence.

The first rule that matches wins:

1. **Degraded** — the rollout was aborted (by an operator, by a Failed/Error analysis, by the
   progress deadline, or because the pointer was changed outside the rollout). Traffic is back on
   the stable version; it stays Degraded until ``retry`` or a changed spec.
2. **Paused** — manually paused, or waiting at a pause step, or paused by an Inconclusive analysis.
3. **Progressing** — steps remain, or the final pointer write is not observed yet.
4. **Healthy** — the version is the deployment's stable version and nothing is left to do.

The phase is derived, never stored as the source of truth: status keeps the facts (``abort``,
``paused``, ``pause_conditions``, ``completed``) and :func:`phase_of` reads them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.rollouts.status import RolloutStatus

__all__ = ["Phase", "phase_of"]


class Phase(StrEnum):
    """What a rollout is doing, for people and for ``status --watch``."""

    DEGRADED = "Degraded"
    PAUSED = "Paused"
    PROGRESSING = "Progressing"
    HEALTHY = "Healthy"


def phase_of(status: RolloutStatus) -> Phase:
    """The phase the facts in ``status`` amount to."""
    if status.abort:
        return Phase.DEGRADED
    if status.paused or status.pause_conditions:
        return Phase.PAUSED
    if not status.completed:
        return Phase.PROGRESSING
    return Phase.HEALTHY
