"""Preheats and warm pools: create, list with progress, cancel; declare and drop a warm pool.

What they mean to nodes is ``controlplane.staging``. Here:

- **Create a preheat** (operator): the version is a label or digest of a *ready* version of the
  deployment's model; the selector's labels must be node labels. Asking again for the same
  version and selector returns the standing preheat (idempotent: a retried request adds nothing).
  At most ``MAX_PREHEATS`` stand per deployment, so the view every process holds stays small.
- **Progress** comes from heartbeats: of the live nodes (role ``node``) the selector matches, how
  many report the version ``ready`` (fetched and verified by themselves), fetching or failed.
- **Cancel** deletes the preheat: nodes stop protecting the version, which then ages out of their
  disk by LRU unless something else (a pointer, another preheat, a warm pool) still names it.
- **Warm pool**: a selector stored on the deployment row; it is not part of the serving pointer,
  so setting it neither needs ``If-Match`` nor moves the epoch.

Every committed change is announced as ``staging`` (``controlplane.notify``), so parked
desired-state polls of the matching nodes, in every process, answer at once.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.deployments import load_deployment, resolve_ready, to_schema
from controlplane.notify import STAGING
from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import NodeRow, PreheatRow, utcnow
from controlplane.signatures import check_serving
from controlplane.staging import STAGING_ROLE, check_selector, matches
from controlplane.state import AppState
from weightship.errors import ConflictError, NotFoundError
from weightship.logs import event
from weightship.schemas import Deployment, NodeHeartbeat, Preheat, PreheatCreate, VersionState, WarmPool

__all__ = [
    "MAX_PREHEATS",
    "announce_staging",
    "cancel_preheat",
    "create_preheat",
    "list_preheats",
    "preheated_digests",
    "set_warm_pool",
]

log = logging.getLogger(__name__)

#: standing preheats per deployment
MAX_PREHEATS = 64


def _schema(row: PreheatRow) -> Preheat:
    return Preheat(
        id=row.id,
        deployment=row.deployment,
        model=row.model,
        digest=row.digest,
        version=row.version,
        selector=dict(row.selector or {}),
        created_at=row.created_at,
        created_by=row.created_by,
    )


def preheated_digests(session: Session, deployment: str | None = None) -> dict[str, list[str]]:
    """Deployment name -> the digests its standing preheats stage (all deployments, or one)."""
    query = select(PreheatRow.deployment, PreheatRow.digest).order_by(PreheatRow.deployment, PreheatRow.digest)
    if deployment is not None:
        query = query.where(PreheatRow.deployment == deployment)
    found: dict[str, list[str]] = {}
    for name, digest in session.execute(query):
        digests = found.setdefault(name, [])
        if digest not in digests:
            digests.append(digest)
    return found


def create_preheat(state: AppState, deployment: str, body: PreheatCreate, actor: str) -> tuple[Preheat, bool]:
    """Stand up a preheat (or find the same standing one); returns it and whether it is new."""
    selector = check_selector(body.selector, f"preheat of deployment {deployment!r}")
    with database_errors(f"preheating {deployment!r}"), state.sessions() as session, session.begin():
        row = load_deployment(session, deployment)
        digest = resolve_ready(session, row.model, body.version)
        check_serving(state, row.model, [digest])  # staging what nodes would refuse only burns bandwidth
        standing = session.scalars(
            select(PreheatRow).where(PreheatRow.deployment == deployment, PreheatRow.digest == digest)
        ).all()
        for found in standing:
            if tuple(sorted((found.selector or {}).items())) == selector:
                return _schema(found), False
        count = session.scalar(select(func.count()).select_from(PreheatRow).where(PreheatRow.deployment == deployment))
        if (count or 0) >= MAX_PREHEATS:
            raise ConflictError(
                f"deployment {deployment!r} already has {count} standing preheats (the most allowed); cancel some "
                f"with 'weightship preheat {deployment} --cancel ID' (list them with --list) and retry",
                code="too_many_preheats",
                fields={"deployment": deployment, "limit": MAX_PREHEATS},
            )
        preheat = PreheatRow(
            id=uuid.uuid4().hex[:16],
            deployment=deployment,
            model=row.model,
            digest=digest,
            version=body.version,
            selector=dict(selector),
            created_at=utcnow(),
            created_by=actor,
        )
        session.add(preheat)
    event(
        log,
        "preheat.created",
        deployment=deployment,
        preheat=preheat.id,
        version=digest,
        selector=",".join(f"{k}={v}" for k, v in selector) or "*",
        by=actor,
    )
    return _schema(preheat), True


def list_preheats(state: AppState, deployment: str) -> list[Preheat]:
    """The deployment's standing preheats, oldest first, each with its progress across live nodes."""
    now = utcnow()
    with database_errors(f"listing preheats of {deployment!r}"), state.sessions() as session:
        load_deployment(session, deployment)
        rows = session.scalars(
            select(PreheatRow).where(PreheatRow.deployment == deployment).order_by(PreheatRow.created_at, PreheatRow.id)
        ).all()
        nodes = session.scalars(select(NodeRow).where(NodeRow.role == STAGING_ROLE)).all() if rows else []
    stale_after = state.settings.node_stale_seconds
    live = [n for n in nodes if n.last_seen is not None and (now - n.last_seen).total_seconds() <= stale_after]
    reports = {n.id: _inventory(n) for n in live}
    out: list[Preheat] = []
    for row in rows:
        selector = tuple(sorted((row.selector or {}).items()))
        matched = [n for n in live if matches(selector, n.labels or {})]
        states = [reports[n.id].get(row.digest) for n in matched]
        out.append(
            _schema(row).model_copy(
                update={
                    "nodes_matched": len(matched),
                    "nodes_staged": states.count(VersionState.ready),
                    "nodes_fetching": states.count(VersionState.fetching),
                    "nodes_failed": states.count(VersionState.failed),
                }
            )
        )
    return out


def _inventory(node: NodeRow) -> dict[str, VersionState]:
    try:
        report = NodeHeartbeat.model_validate(node.report or {})
    except ValueError:
        return {}  # a report an older agent wrote: counted as holding nothing
    return {item.digest: item.state for item in report.inventory}


def cancel_preheat(state: AppState, deployment: str, preheat_id: str) -> None:
    """Delete a standing preheat; 404 when the deployment has no such preheat."""
    with database_errors(f"cancelling preheat {preheat_id!r}"), state.sessions() as session, session.begin():
        load_deployment(session, deployment)
        row = session.get(PreheatRow, preheat_id)
        if row is None or row.deployment != deployment:
            raise NotFoundError(
                f"deployment {deployment!r} has no preheat {preheat_id!r}; list them with "
                f"'weightship preheat {deployment} --list'",
                code="preheat_not_found",
                fields={"deployment": deployment, "preheat": preheat_id},
            )
        session.delete(row)
    event(log, "preheat.cancelled", deployment=deployment, preheat=preheat_id)


def set_warm_pool(state: AppState, deployment: str, pool: WarmPool | None, actor: str) -> Deployment:
    """Declare (or, with ``None``, drop) the deployment's warm pool."""
    selector = check_selector(pool.selector, f"warm pool of deployment {deployment!r}") if pool else None
    with database_errors(f"setting the warm pool of {deployment!r}"), state.sessions() as session, session.begin():
        row = load_deployment(session, deployment)
        row.warm_pool = dict(selector) if selector is not None else None
        preheated = preheated_digests(session, deployment).get(deployment, [])
    event(
        log,
        "warm_pool.set",
        deployment=deployment,
        selector="none" if selector is None else ",".join(f"{k}={v}" for k, v in selector) or "*",
        by=actor,
    )
    return to_schema(row, preheated)


async def announce_staging(state: AppState) -> None:
    """Announce a committed preheat or warm-pool change to every process."""
    await state.changes.announce(STAGING)
