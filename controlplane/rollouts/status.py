"""Rollout status: everything needed to pick a rollout up again after a restart, and its JSON form.

The engine keeps no memory between calls; the status is its memory, and the control plane stores it
verbatim (``to_dict``/``from_dict``). It holds facts, not intentions:

- ``revision`` — fingerprint of the spec this status belongs to; a different one restarts;
- ``version`` / ``stable`` — the canary being rolled out and the stable version captured when the
  rollout started: the rollback target, so an abort after a restart still knows where to go;
- ``attempt`` — 1 for the first try, +1 per ``retry``; analysis run ids include it;
- ``step_index`` and ``step_entered_at`` — where the rollout is and since when (None: the step is
  entered on the next reconcile, which is how verbs move the index without needing a clock);
- ``deadline_at`` — when the current fleet-waiting step (prefetch, setWeight) gives up;
- ``pause_conditions`` (pause step, inconclusive analysis, each with its start), ``paused`` (manual);
- ``abort``, ``aborted_at``, ``abort_reason`` — set by the abort verb or by the engine;
- ``promote_full`` and ``promote_reason`` — skip all remaining steps, and why (``promote --full``,
  first deploy); ``completed`` — the final pointer was observed;
- ``analysis_runs`` — the runs of the current attempt with every measurement.

Times are timezone-aware ``datetime`` values, stored as ISO 8601 text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from controlplane.rollouts.analysis import AnalysisPhase, AnalysisRun, Measurement, MeasurementPhase, MetricRun
from controlplane.rollouts.phases import Phase, phase_of
from weightship.errors import ValidationError

__all__ = ["STATUS_SCHEMA", "PauseCondition", "PauseReason", "RolloutStatus", "StatusError"]

#: Bumped when the stored form changes incompatibly; ``from_dict`` refuses other schemas.
STATUS_SCHEMA = 1


class StatusError(ValidationError):
    """A stored status cannot be read back; it was written by another schema or corrupted."""


class PauseReason:
    """Why a rollout is paused (besides a manual pause)."""

    PAUSE_STEP = "PauseStep"
    INCONCLUSIVE_ANALYSIS = "InconclusiveAnalysis"


@dataclass(frozen=True)
class PauseCondition:
    """One reason the rollout is paused, and since when."""

    reason: str
    started_at: datetime


@dataclass(frozen=True)
class RolloutStatus:
    """The rollout's persisted state; see the module docstring for each field."""

    revision: str = ""
    version: str | None = None
    stable: str | None = None
    attempt: int = 0
    step_index: int = 0
    step_entered_at: datetime | None = None
    deadline_at: datetime | None = None
    pause_conditions: tuple[PauseCondition, ...] = ()
    paused: bool = False
    paused_at: datetime | None = None
    abort: bool = False
    aborted_at: datetime | None = None
    abort_reason: str = ""
    promote_full: bool = False
    promote_reason: str = ""
    completed: bool = False
    analysis_runs: tuple[AnalysisRun, ...] = field(default=())
    message: str = ""

    @property
    def phase(self) -> Phase:
        """Derived phase (Degraded > Paused > Progressing > Healthy)."""
        return phase_of(self)

    def run_for_step(self, step_index: int) -> AnalysisRun | None:
        """The current attempt's analysis run for ``step_index``, if it started."""
        return next((r for r in self.analysis_runs if r.step_index == step_index), None)

    def with_run(self, run: AnalysisRun) -> RolloutStatus:
        """This status with ``run`` added or replacing the run of the same id."""
        others = tuple(r for r in self.analysis_runs if r.run_id != run.run_id)
        return replace(self, analysis_runs=(*others, run))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (with ``phase`` for readers; it is recomputed on load)."""
        return {
            "schema": STATUS_SCHEMA,
            "phase": str(self.phase),
            "revision": self.revision,
            "version": self.version,
            "stable": self.stable,
            "attempt": self.attempt,
            "stepIndex": self.step_index,
            "stepEnteredAt": _time_out(self.step_entered_at),
            "deadlineAt": _time_out(self.deadline_at),
            "pauseConditions": [
                {"reason": p.reason, "startedAt": _time_out(p.started_at)} for p in self.pause_conditions
            ],
            "paused": self.paused,
            "pausedAt": _time_out(self.paused_at),
            "abort": self.abort,
            "abortedAt": _time_out(self.aborted_at),
            "abortReason": self.abort_reason,
            "promoteFull": self.promote_full,
            "promoteReason": self.promote_reason,
            "completed": self.completed,
            "analysisRuns": [_run_out(r) for r in self.analysis_runs],
            "message": self.message,
        }

    @classmethod
    def from_dict(cls, data: object) -> RolloutStatus:
        """Read a stored status back; raise :class:`StatusError` naming what is wrong."""
        if not isinstance(data, Mapping):
            raise StatusError(f"rollout status: expected a mapping, got {type(data).__name__}")
        if data.get("schema") != STATUS_SCHEMA:
            raise StatusError(
                f"rollout status: schema {data.get('schema')!r} is not {STATUS_SCHEMA}; it was written by another release"
            )
        try:
            # Nullable fields may be absent: a JSON merge patch (RFC 7386, how a Kubernetes status is
            # written) stores a null by deleting the key, so absent and null mean the same here.
            return cls(
                revision=str(data["revision"]),
                version=data.get("version"),
                stable=data.get("stable"),
                attempt=int(data["attempt"]),
                step_index=int(data["stepIndex"]),
                step_entered_at=_time_in(data.get("stepEnteredAt")),
                deadline_at=_time_in(data.get("deadlineAt")),
                pause_conditions=tuple(
                    PauseCondition(str(p["reason"]), _required_time(p["startedAt"])) for p in data["pauseConditions"]
                ),
                paused=bool(data["paused"]),
                paused_at=_time_in(data.get("pausedAt")),
                abort=bool(data["abort"]),
                aborted_at=_time_in(data.get("abortedAt")),
                abort_reason=str(data["abortReason"]),
                promote_full=bool(data["promoteFull"]),
                promote_reason=str(data["promoteReason"]),
                completed=bool(data["completed"]),
                analysis_runs=tuple(_run_in(r) for r in data["analysisRuns"]),
                message=str(data["message"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StatusError(
                f"rollout status: field missing or malformed ({type(exc).__name__}: {exc}); it cannot be resumed"
            ) from None


def _time_out(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _time_in(value: object) -> datetime | None:
    return None if value is None else _required_time(value)


def _required_time(value: object) -> datetime:
    if not isinstance(value, str):
        raise TypeError(f"expected an ISO 8601 time, got {value!r}")
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError(f"time {value!r} has no timezone")
    return parsed


def _run_out(run: AnalysisRun) -> dict[str, Any]:
    return {
        "runId": run.run_id,
        "stepIndex": run.step_index,
        "startedAt": _time_out(run.started_at),
        "phase": str(run.phase),
        "message": run.message,
        "metrics": [
            {
                "name": m.name,
                "phase": str(m.phase),
                "message": m.message,
                "count": m.count,
                "successful": m.successful,
                "failed": m.failed,
                "inconclusive": m.inconclusive,
                "errors": m.errors,
                "consecutiveErrors": m.consecutive_errors,
                "measurements": [
                    {
                        "index": x.index,
                        "phase": str(x.phase),
                        "takenAt": _time_out(x.taken_at),
                        "value": x.value,
                        "message": x.message,
                    }
                    for x in m.measurements
                ],
            }
            for m in run.metrics
        ],
    }


def _run_in(data: Mapping[str, Any]) -> AnalysisRun:
    metrics = tuple(
        MetricRun(
            name=str(m["name"]),
            phase=AnalysisPhase(m["phase"]),
            message=str(m["message"]),
            count=int(m["count"]),
            successful=int(m["successful"]),
            failed=int(m["failed"]),
            inconclusive=int(m["inconclusive"]),
            errors=int(m["errors"]),
            consecutive_errors=int(m["consecutiveErrors"]),
            measurements=tuple(
                Measurement(
                    int(x["index"]),
                    MeasurementPhase(x["phase"]),
                    _required_time(x["takenAt"]),
                    x.get("value"),
                    str(x["message"]),
                )
                for x in m["measurements"]
            ),
        )
        for m in data["metrics"]
    )
    return AnalysisRun(
        run_id=str(data["runId"]),
        step_index=int(data["stepIndex"]),
        started_at=_required_time(data["startedAt"]),
        metrics=metrics,
        phase=AnalysisPhase(data["phase"]),
        message=str(data["message"]),
    )
