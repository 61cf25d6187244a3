"""Deployments and their serving pointers: create, read, compare-and-swap, roll back, audit.

A deployment's row *is* its serving pointer: ``stable``, ``previous_stable``, ``canary`` with its
``canary_share``, and ``epoch``. The rules this module keeps:

- **Every change is a compare-and-swap on the epoch.** Clients read the pointer (``ETag: "<epoch>"``)
  and send it back in ``If-Match``; the write is one statement,
  ``UPDATE deployments SET ..., epoch = :expected + 1 WHERE name = :name AND epoch = :expected``.
  Zero rows updated means someone else moved the pointer first: ``412 Precondition Failed``, and
  the client must read again and re-apply its change. PostgreSQL (READ COMMITTED) re-evaluates the
  WHERE clause after waiting for a concurrent writer; SQLite serialises writers; on both, exactly
  one of several racing writers with the same ``If-Match`` wins. No locks are held between the read
  and the write: the values written were computed from the row at ``:expected``, and any other
  write would have moved the epoch.
- **Every change writes one audit row** (``pointer_events``: epoch, action, who, why, from, to) in
  the same transaction; ``(deployment, epoch)`` is unique, a second fence against double writes.
- **Epochs only grow.** A rollback is a new, higher epoch naming the older digest, so agents that
  refuse lower epochs (anti-rollback) still accept it.
- **Refs** (in a pointer update or a rollback) are labels or ``sha256:`` digests of *ready*
  versions of the deployment's own model.
- **``previous_stable``** is whatever was stable before ``stable`` last changed; a rollback swaps
  the two, so rolling back twice returns to where you started.

After every committed change the change is announced on the change feed (``controlplane.notify``),
so that desired-state long-polls (``controlplane.fleet``) in every process answer at once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import exc, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from controlplane.notify import DEPLOYMENTS
from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import DeploymentRow, ModelRow, PointerEventRow, VersionRow, utcnow
from controlplane.registry import resolve_version
from controlplane.signatures import check_serving
from controlplane.staging import check_selector
from controlplane.state import AppState
from weightship.errors import (
    ConflictError,
    NotFoundError,
    PreconditionFailed,
    PreconditionRequired,
    ValidationError,
)
from weightship.logs import event
from weightship.schemas import (
    Deployment,
    DeploymentCreate,
    PointerEvent,
    PointerUpdate,
    RollbackRequest,
    WarmPool,
)

__all__ = [
    "Pointer",
    "change_pointer",
    "etag",
    "event_schema",
    "load_deployment",
    "move_pointer",
    "new_deployment",
    "notify_pointer_changed",
    "parse_if_match",
    "pointer_action",
    "resolve_ready",
    "roll_back",
    "to_schema",
]

log = logging.getLogger(__name__)



_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ETAG = re.compile(r'^(?:W/)?(?:"(\d{1,18})"|(\d{1,18}))$')


@dataclass(frozen=True, slots=True)
class Pointer:
    """The movable part of a deployment row."""

    stable: str | None
    previous_stable: str | None
    canary: str | None
    canary_share: float

    @classmethod
    def of(cls, row: DeploymentRow) -> Pointer:
        """The pointer a row holds."""
        return cls(row.stable, row.previous_stable, row.canary, row.canary_share)


def etag(epoch: int) -> str:
    """The strong ETag of a pointer at ``epoch``."""
    return f'"{epoch}"'


def parse_if_match(value: str | None, deployment: str) -> int:
    """The epoch an ``If-Match`` header expects; 428 when it is missing, 400 when malformed."""
    if value is None or not value.strip():
        raise PreconditionRequired(
            f"changing the pointer of {deployment!r} needs an If-Match header: GET /v1/deployments/{deployment} "
            'and send its ETag back, e.g. If-Match: "3"',
            fields={"deployment": deployment},
        )
    match = _ETAG.match(value.strip())
    if match is None:
        raise ValidationError(
            f'If-Match must be one ETag as returned by GET /v1/deployments/{deployment} (e.g. "3"); got {value!r}',
            code="if_match_invalid",
            fields={"deployment": deployment},
        )
    return int(match.group(1) or match.group(2))


def to_schema(row: DeploymentRow, preheated: Sequence[str] = ()) -> Deployment:
    """A deployment row as the API shows it (``preheated``: the digests its standing preheats stage)."""
    return Deployment(
        name=row.name,
        model=row.model,
        stable=row.stable,
        previous_stable=row.previous_stable,
        canary=row.canary,
        canary_share=row.canary_share,
        epoch=row.epoch,
        updated_at=row.updated_at,
        warm_pool=WarmPool(selector=row.warm_pool) if row.warm_pool is not None else None,
        preheated=list(preheated),
    )


def event_schema(row: PointerEventRow) -> PointerEvent:
    return PointerEvent(
        epoch=row.epoch,
        action=row.action,
        actor=row.actor,
        reason=row.reason,
        from_stable=row.from_stable,
        to_stable=row.to_stable,
        from_canary=row.from_canary,
        to_canary=row.to_canary,
        canary_share=row.canary_share,
        at=row.at,
    )


def load_deployment(session: Session, name: str) -> DeploymentRow:
    row = session.get(DeploymentRow, name)
    if row is None:
        raise NotFoundError(
            f"deployment {name!r} does not exist; create it with POST /v1/deployments",
            code="deployment_not_found",
            fields={"deployment": name},
        )
    return row


def resolve_ready(session: Session, model: str, ref: str) -> str:
    """The digest of the ready version of ``model`` that ``ref`` (label or ``sha256:`` digest) names."""
    try:
        version = resolve_version(session, model, ref)
    except NotFoundError:
        other = session.get(VersionRow, ref) if ref.startswith("sha256:") else None
        if other is not None:
            raise ConflictError(
                f"version {ref} belongs to model {other.model!r}, but this deployment serves model {model!r}",
                code="version_of_other_model",
                fields={"version": ref, "model": model, "version_model": other.model},
            ) from None
        raise
    if version.state != "ready":
        raise ConflictError(
            f"version {version.digest} of model {model!r} is {version.state!r}, not ready; only ready versions can be served",
            code="version_not_ready",
            fields={"model": model, "version": ref, "state": version.state},
        )
    return version.digest


def _current_epoch(session: Session, name: str) -> int | None:
    return session.scalar(select(DeploymentRow.epoch).where(DeploymentRow.name == name))


def _stale(state: AppState, name: str, expected: int, current: int | None) -> PreconditionFailed:
    """The 412 of a lost compare-and-swap; ``current`` is read by the caller in the session it holds.

    Never opens a session of its own: callers hold one, and a second per request is how a burst
    of stale writers used to exhaust the pool and stall the whole API.
    """
    state.metrics.pointer_conflicts.labels(deployment=name).inc()
    event(log, "pointer.cas_lost", deployment=name, expected_epoch=expected, current_epoch=current)
    return PreconditionFailed(
        f"deployment {name!r} is at epoch {current} (ETag {etag(current or 0)}), not {expected}: someone changed it; "
        "GET it again, re-apply your change and retry",
        code="pointer_stale",
        fields={"deployment": name, "epoch": current, "expected_epoch": expected},
    )


def change_pointer(
    state: AppState,
    name: str,
    expected: int,
    before: Pointer,
    after: Pointer,
    *,
    model: str,
    action: str,
    actor: str,
    reason: str,
) -> Deployment:
    """Compare-and-swap the pointer of ``name`` from epoch ``expected`` (holding ``before``) to ``after``.

    Writes the audit row in the same transaction; raises ``PreconditionFailed`` when the epoch
    moved, ``SignatureRefused`` when a version it brings in fails the signing policy. Blocking:
    call from a worker thread, then ``await notify_pointer_changed(state)``.
    """
    check_serving(state, model, {after.stable, after.canary} - {before.stable, before.canary})
    now = utcnow()
    won = False
    current: int | None = None
    try:
        with database_errors(f"moving pointer {name!r}"), state.sessions() as session, session.begin():
            result = cast(
                "CursorResult[Any]",
                session.execute(
                    update(DeploymentRow)
                    .where(DeploymentRow.name == name, DeploymentRow.epoch == expected)
                    .values(
                        stable=after.stable,
                        previous_stable=after.previous_stable,
                        canary=after.canary,
                        canary_share=after.canary_share,
                        epoch=expected + 1,
                        updated_at=now,
                    )
                    .execution_options(synchronize_session=False)
                ),
            )
            won = result.rowcount == 1
            if not won:
                current = _current_epoch(session, name)
            else:
                session.add(
                    PointerEventRow(
                        deployment=name,
                        epoch=expected + 1,
                        action=action,
                        actor=actor,
                        reason=reason,
                        from_stable=before.stable,
                        to_stable=after.stable,
                        from_canary=before.canary,
                        to_canary=after.canary,
                        canary_share=after.canary_share,
                        at=now,
                    )
                )
    except exc.IntegrityError as err:
        # The unique (deployment, epoch) audit row says another writer took this epoch. The
        # session above is closed by now, so reading the winner's epoch takes no second connection.
        with database_errors(f"reading pointer {name!r}"), state.sessions() as session:
            current = _current_epoch(session, name)
        raise _stale(state, name, expected, current) from err
    if not won:
        raise _stale(state, name, expected, current)
    state.metrics.pointer_changes.labels(deployment=name, action=action).inc()
    event(
        log,
        "pointer.changed",
        deployment=name,
        epoch=expected + 1,
        action=action,
        actor=actor,
        stable=after.stable,
        canary=after.canary,
        share=after.canary_share,
    )
    return Deployment(
        name=name,
        model=model,
        stable=after.stable,
        previous_stable=after.previous_stable,
        canary=after.canary,
        canary_share=after.canary_share,
        epoch=expected + 1,
        updated_at=now,
    )


async def notify_pointer_changed(state: AppState) -> None:
    """Announce a committed pointer change to every process, whose long-polls it moved then answer."""
    state.pointer_generation += 1
    await state.changes.announce(DEPLOYMENTS)


def pointer_action(before: Pointer, after: Pointer) -> str:
    """The audit action of a pointer change: ``promote``, ``abort``, ``canary`` or ``set``."""
    if before.canary is not None and after.canary is None and after.stable == before.canary != before.stable:
        return "promote"
    if after.stable == before.stable and after.canary is None and before.canary is not None:
        return "abort"
    if after.stable == before.stable and after.canary is not None:
        return "canary"
    return "set"


def move_pointer(state: AppState, name: str, expected: int, body: PointerUpdate, actor: str) -> Deployment:
    if body.canary is None and body.canary_share > 0:
        raise ValidationError(
            f"canary_share is {body.canary_share} but no canary is named; name one or set the share to 0",
            code="share_without_canary",
            fields={"deployment": name, "share": body.canary_share},
        )
    with state.sessions() as session:
        row = load_deployment(session, name)
        if row.epoch != expected:
            raise _stale(state, name, expected, row.epoch)
        stable = resolve_ready(session, row.model, body.stable)
        canary = resolve_ready(session, row.model, body.canary) if body.canary is not None else None
        before = Pointer.of(row)
        model = row.model
    if canary == stable:
        raise ValidationError(
            f"canary and stable are the same version {stable}; omit the canary to serve it everywhere",
            code="canary_is_stable",
            fields={"deployment": name, "version": stable},
        )
    after = Pointer(
        stable=stable,
        previous_stable=before.stable if stable != before.stable else before.previous_stable,
        canary=canary,
        canary_share=body.canary_share if canary is not None else 0.0,
    )
    return change_pointer(
        state,
        name,
        expected,
        before,
        after,
        model=model,
        action=pointer_action(before, after),
        actor=actor,
        reason=body.reason,
    )


def roll_back(state: AppState, name: str, expected: int | None, body: RollbackRequest, actor: str) -> Deployment:
    with state.sessions() as session:
        row = load_deployment(session, name)
        if expected is not None and row.epoch != expected:
            raise _stale(state, name, expected, row.epoch)
        if body.to is not None:
            target = resolve_ready(session, row.model, body.to)
        elif row.previous_stable is None:
            raise ConflictError(
                f"deployment {name!r} has no previous stable version to roll back to "
                f"(stable is {row.stable or 'unset'}); name a ready version with 'to' (label or digest)",
                code="no_previous_stable",
                fields={"deployment": name, "stable": row.stable},
            )
        else:
            target = resolve_ready(session, row.model, row.previous_stable)
        before = Pointer.of(row)
        epoch, model = row.epoch, row.model
    if target == before.stable:
        raise ConflictError(
            f"deployment {name!r} already serves {target} as stable; to drop a canary, PUT the pointer without one",
            code="already_stable",
            fields={"deployment": name, "version": target},
        )
    after = Pointer(stable=target, previous_stable=before.stable, canary=None, canary_share=0.0)
    return change_pointer(
        state, name, epoch, before, after, model=model, action="rollback", actor=actor, reason=body.reason
    )


def new_deployment(state: AppState, body: DeploymentCreate) -> Deployment:
    pool = body.warm_pool
    warm_pool = dict(check_selector(pool.selector, f"warm pool of deployment {body.name!r}")) if pool else None
    row = DeploymentRow(
        name=body.name,
        model=body.model,
        stable=None,
        previous_stable=None,
        canary=None,
        canary_share=0.0,
        epoch=0,
        updated_at=utcnow(),
        publisher_rollouts=body.publisher_rollouts or None,
        warm_pool=warm_pool,
    )
    with state.sessions() as session:
        if session.get(ModelRow, body.model) is None:
            raise NotFoundError(
                f"model {body.model!r} does not exist; publish a version of it first",
                code="model_not_found",
                fields={"model": body.model},
            )
        if session.get(DeploymentRow, body.name) is not None:
            raise ConflictError(
                f"deployment {body.name!r} already exists; pick another name or GET it",
                code="deployment_exists",
                fields={"deployment": body.name},
            )
        session.add(row)
        try:
            session.commit()
        except exc.IntegrityError as err:
            raise ConflictError(
                f"deployment {body.name!r} already exists; pick another name or GET it",
                code="deployment_exists",
                fields={"deployment": body.name},
            ) from err
    event(log, "deployment.created", deployment=body.name, model=body.model)
    return to_schema(row)


