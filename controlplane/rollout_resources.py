"""Rollout resources: create, read, list and act on rollouts of a deployment (``/v1/.../rollouts``).

A rollout row (``controlplane.persistence.rows.RolloutRow``) holds the spec as created (its
``version`` resolved to a digest), the engine's status (``controlplane.rollouts.status``), and
what the driver last saw of the fleet. This module keeps the rules of the resource; the fleet
driver (``controlplane.rollout_driver``) moves it forward.

- **One active rollout per deployment**, guaranteed by the database: ``active_deployment`` is the
  deployment's name while the rollout is active (else NULL) and is UNIQUE. A second rollout is
  refused with 409 ``rollout_active`` naming the active one. A rollout stops being active once
  it is complete, or aborted with traffic back on stable; ``retry`` makes it active again.
- **Who may start one**: operators and admins; publishers only where the deployment allows it
  (``publisher_rollouts``).
- **Verbs** (promote, promote-full, pause, resume, abort, retry) change the stored status only,
  as in Argo Rollouts; the driver acts on it at its next reconcile. Every status write is a
  compare-and-swap on ``row_version``, so a verb and a driver reconcile never overwrite each other:
  the loser reads again.
- **Every measurement is kept**: the status holds the current attempt's analysis runs; a retry
  moves the earlier attempt's runs to ``past_runs`` first.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, cast

from sqlalchemy import exc, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from controlplane.auth import Principal
from controlplane.deployments import load_deployment, resolve_ready
from controlplane.persistence.rows import DeploymentRow, RolloutRow, utcnow
from controlplane.rollouts import verbs
from controlplane.rollouts.spec import AnalysisStep, PauseStep, PrefetchStep, RolloutSpec, RolloutSpecError, parse_spec
from controlplane.rollouts.status import RolloutStatus, StatusError
from controlplane.rollouts.steps import describe
from controlplane.signatures import check_serving
from controlplane.state import AppState
from weightship.errors import ConflictError, ForbiddenError, NotFoundError, WeightshipError
from weightship.logs import event
from weightship.modelrollout import RolloutVerb
from weightship.schemas import (
    Role,
    Rollout,
    RolloutAnalysisRun,
    RolloutCreate,
    RolloutMeasurement,
    RolloutMetric,
    RolloutStep,
)

__all__ = [
    "CURRENT",
    "ROLLOUTS",
    "RolloutActive",
    "RolloutSpecInvalid",
    "RolloutVerbRefused",
    "SpecCheck",
    "apply_verb",
    "create_rollout",
    "get_rollout",
    "list_rollouts",
    "rollout_schema",
]

log = logging.getLogger(__name__)

#: the change-feed topic announcing that a rollout was created or acted on (wakes every driver)
ROLLOUTS = "rollouts"
#: the rollout id that names the deployment's active rollout, else its latest
CURRENT = "current"
_WRITE_RETRIES = 5

#: checks a parsed spec against what this control plane can measure (the providers' settings)
SpecCheck = Callable[[RolloutSpec], None]


class RolloutActive(ConflictError):
    """The deployment already has an active rollout."""

    code = "rollout_active"


class RolloutVerbRefused(ConflictError):
    """The verb does not fit the rollout's state; the message says which verb does."""

    code = "rollout_verb"


class RolloutSpecInvalid(WeightshipError):
    """The rollout spec is malformed or asks for a provider this control plane lacks; the message names the field."""

    status_code = 422
    code = "rollout_spec"


def _active_conflict(deployment: str, active_id: str) -> RolloutActive:
    return RolloutActive(
        f"deployment {deployment!r} already has an active rollout {active_id}: abort it "
        f"(weightship rollout abort {deployment}) or wait until it completes, then start the new one",
        fields={"deployment": deployment, "rollout": active_id},
    )


def _active_id(session: Session, deployment: str) -> str | None:
    return session.scalar(select(RolloutRow.id).where(RolloutRow.active_deployment == deployment))


def create_rollout(
    state: AppState, deployment: str, body: RolloutCreate, principal: Principal, check: SpecCheck
) -> Rollout:
    """Store a new, active rollout of ``deployment``; 404/409/422/403 as the module docstring says."""
    raw: dict[str, Any] = dict(body.spec)
    with state.sessions() as session:
        row = load_deployment(session, deployment)
        if principal.role == Role.publisher and not row.publisher_rollouts:
            raise ForbiddenError(
                f"token {principal.name!r} is a publisher; deployment {deployment!r} does not let publishers start "
                "rollouts: ask an operator, or create the deployment with publisher_rollouts true",
                code="role_refused",
                fields={"deployment": deployment, "token": principal.name},
            )
        ref = raw.get("version")
        if not isinstance(ref, str) or not ref:
            raise RolloutSpecInvalid("version: required: a label or sha256: digest of a ready version to roll out")
        raw["version"] = resolve_ready(session, row.model, ref)
        check_serving(state, row.model, [raw["version"]])  # refused before any step moves the pointer
        try:
            spec = parse_spec(raw)
            check(spec)
        except RolloutSpecError as err:
            raise RolloutSpecInvalid(err.message, fields={"deployment": deployment}) from None
        active = _active_id(session, deployment)
        if active is not None:
            raise _active_conflict(deployment, active)
        now = utcnow()
        new = RolloutRow(
            id=uuid.uuid4().hex[:12],
            deployment=deployment,
            active_deployment=deployment,
            version=spec.version,
            spec=raw,
            status=None,
            past_runs=[],
            fleet={},
            row_version=0,
            lease_holder=None,
            lease_expires_at=None,
            created_by=principal.name,
            created_at=now,
            updated_at=now,
        )
        session.add(new)
        try:
            session.commit()
        except exc.IntegrityError:
            # Another rollout of this deployment became active between the check and the insert.
            session.rollback()
            raise _active_conflict(deployment, _active_id(session, deployment) or "(just finished)") from None
        event(log, "rollout.created", rollout=new.id, deployment=deployment, version=spec.version, by=principal.name)
        return rollout_schema(new, row.model)


def _find(session: Session, deployment: str, rollout_id: str) -> RolloutRow:
    load_deployment(session, deployment)
    if rollout_id == CURRENT:
        query = select(RolloutRow).where(RolloutRow.deployment == deployment)
        row = session.scalars(query.where(RolloutRow.active_deployment.is_not(None))).first()
        row = row or session.scalars(query.order_by(RolloutRow.created_at.desc()).limit(1)).first()
    else:
        row = session.get(RolloutRow, rollout_id)
        row = row if row is not None and row.deployment == deployment else None
    if row is None:
        raise NotFoundError(
            f"deployment {deployment!r} has no rollout {rollout_id!r}; list them with "
            f"GET /v1/deployments/{deployment}/rollouts",
            code="rollout_not_found",
            fields={"deployment": deployment, "rollout": rollout_id},
        )
    return row


def get_rollout(state: AppState, deployment: str, rollout_id: str) -> Rollout:
    """One rollout (``current``: the active one, else the latest)."""
    with state.sessions() as session:
        row = _find(session, deployment, rollout_id)
        return rollout_schema(row, load_deployment(session, deployment).model)


def list_rollouts(state: AppState, deployment: str | None, *, active: bool, limit: int) -> list[Rollout]:
    """Rollouts newest first: of one deployment, or of all; only active ones with ``active``."""
    with state.sessions() as session:
        query = select(RolloutRow)
        if deployment is not None:
            load_deployment(session, deployment)
            query = query.where(RolloutRow.deployment == deployment)
        if active:
            query = query.where(RolloutRow.active_deployment.is_not(None))
        rows = session.scalars(query.order_by(RolloutRow.created_at.desc(), RolloutRow.id).limit(limit)).all()
        models = {name: model for name, model in session.execute(select(DeploymentRow.name, DeploymentRow.model))}
        return [rollout_schema(row, models.get(row.deployment, "")) for row in rows]


def apply_verb(state: AppState, deployment: str, rollout_id: str, verb: RolloutVerb, principal: Principal) -> Rollout:
    """Apply ``verb`` to the stored status (compare-and-swap on ``row_version``); 409 ``rollout_verb`` if it does not fit."""
    function = verbs.BY_NAME[verb]
    for _ in range(_WRITE_RETRIES):
        now = utcnow()
        with state.sessions() as session:
            row = _find(session, deployment, rollout_id)
            model = load_deployment(session, deployment).model
            if row.status is None:
                raise RolloutVerbRefused(
                    f"{verb}: rollout {row.id} has not been reconciled yet; try again in a moment",
                    fields={"rollout": row.id},
                )
            spec = parse_spec(row.spec)
            status = _status(row)
            try:
                changed = function(spec, status, now)
            except verbs.VerbError as err:
                raise RolloutVerbRefused(err.message, fields={"rollout": row.id, "verb": verb}) from None
            values: dict[str, Any] = {
                "status": changed.to_dict(),
                "row_version": row.row_version + 1,
                "updated_at": now,
            }
            if verb == "retry":
                values["past_runs"] = [*row.past_runs, *status.to_dict()["analysisRuns"]]
                if row.active_deployment is None:
                    active = _active_id(session, deployment)
                    if active is not None:
                        raise _active_conflict(deployment, active)
                    values["active_deployment"] = deployment
            try:
                result = cast(
                    "CursorResult[Any]",
                    session.execute(
                        update(RolloutRow)
                        .where(RolloutRow.id == row.id, RolloutRow.row_version == row.row_version)
                        .values(**values)
                        .execution_options(synchronize_session=False)
                    ),
                )
                session.commit()
            except exc.IntegrityError:
                session.rollback()
                raise _active_conflict(deployment, _active_id(session, deployment) or "(another)") from None
            if result.rowcount != 1:
                continue  # the driver (or another verb) wrote meanwhile: apply to what it wrote
            session.expire_all()
            stored = session.get(RolloutRow, row.id)
            assert stored is not None
            event(log, "rollout.verb", rollout=row.id, deployment=deployment, verb=verb, by=principal.name)
            return rollout_schema(stored, model)
    raise ConflictError(
        f"{verb}: rollout {rollout_id} changed {_WRITE_RETRIES} times while the verb was applied; try again",
        code="rollout_busy",
    )


def _status(row: RolloutRow) -> RolloutStatus:
    try:
        return RolloutStatus.from_dict(row.status)
    except StatusError as err:
        raise ConflictError(
            f"rollout {row.id}: its stored status cannot be read ({err.message}); start a new rollout",
            code="rollout_status",
        ) from None


# --- the API's view --------------------------------------------------------------------------------


def _kind(spec: RolloutSpec, index: int) -> str:
    step = spec.steps[index]
    if isinstance(step, AnalysisStep):
        return "analysis"
    if isinstance(step, PauseStep):
        return "pause"
    if isinstance(step, PrefetchStep):
        return "prefetch"
    return "setWeight"


def _runs(runs: list[Mapping[str, Any]]) -> list[RolloutAnalysisRun]:
    return [
        RolloutAnalysisRun(
            id=str(run["runId"]),
            step_index=int(run["stepIndex"]),
            phase=str(run["phase"]),
            metrics=[
                RolloutMetric(
                    name=str(metric["name"]),
                    phase=str(metric["phase"]),
                    measurements=[
                        RolloutMeasurement(
                            index=int(m["index"]),
                            phase=str(m["phase"]),
                            value=m["value"],
                            started_at=datetime.fromisoformat(m["takenAt"]),
                            finished_at=datetime.fromisoformat(m["takenAt"]),
                            message=str(m["message"]),
                        )
                        for m in metric["measurements"]
                    ],
                )
                for metric in run["metrics"]
            ],
        )
        for run in runs
    ]


def rollout_schema(row: RolloutRow, model: str) -> Rollout:
    """A rollout row as the API shows it (see ``weightship.schemas.Rollout``)."""
    spec = parse_spec(row.spec)
    status = RolloutStatus.from_dict(row.status) if row.status is not None else None
    index = status.step_index if status is not None else 0
    finished = status is not None and (status.completed or status.promote_full)
    steps = [
        RolloutStep(
            index=i,
            kind=cast("Any", _kind(spec, i)),
            summary=describe(spec, i),
            state="done" if i < index or finished else "current" if i == index else "pending",
        )
        for i in range(len(spec.steps))
    ]
    fleet = row.fleet or {}
    current_runs = status.to_dict()["analysisRuns"] if status is not None else []
    return Rollout(
        id=row.id,
        deployment=row.deployment,
        model=model,
        version=row.version,
        stable=status.stable if status is not None else None,
        phase=cast("Any", str(status.phase)) if status is not None else "Progressing",
        message=status.message if status is not None else "waiting for the rollout driver's first reconcile",
        completed=bool(status and status.completed),
        aborted=bool(status and status.abort),
        step_index=index,
        steps_total=len(spec.steps),
        steps=steps,
        weight=float(fleet.get("weight", 0.0)),
        attempt=status.attempt if status is not None else 0,
        analysis_runs=_runs([*row.past_runs, *current_runs]),
        nodes={str(k): int(v) for k, v in (fleet.get("nodes") or {}).items()},
        staged_nodes=int(fleet.get("staged_nodes", 0)),
        target_nodes=int(fleet.get("target_nodes", 0)),
        spec=dict(row.spec),
        status=dict(row.status or {}),
        created_at=row.created_at,
        created_by=row.created_by,
        updated_at=row.updated_at,
    )
