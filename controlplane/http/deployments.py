"""HTTP routes of deployments and their serving pointers (``controlplane.deployments``): ``ETag``/``If-Match`` compare-and-swap, rollback, audit history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response, status
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from controlplane.auth import ANY_ROLE, Principal
from controlplane.deployments import (
    etag,
    event_schema,
    load_deployment,
    move_pointer,
    new_deployment,
    notify_pointer_changed,
    parse_if_match,
    roll_back,
    to_schema,
)
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.persistence.rows import DeploymentRow, PointerEventRow
from controlplane.preheats import announce_staging, preheated_digests
from weightship.schemas import (
    INT64_MAX,
    Deployment,
    DeploymentCreate,
    PointerEvent,
    PointerUpdate,
    Role,
    RollbackRequest,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/deployments", tags=["deployments"])


IfMatch = Annotated[str | None, Header(alias="If-Match")]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Deployment, responses=errors(404, 409))
async def create_deployment(
    body: DeploymentCreate,
    request: Request,
    response: Response,
    _principal: Principal = Depends(require(Role.operator)),
) -> Deployment:
    """Create a deployment of a model; its pointer is empty (epoch 0) until set."""
    state = state_of(request)
    deployment = await run_in_threadpool(new_deployment, state, body)
    await notify_pointer_changed(state)
    if body.warm_pool is not None:
        await announce_staging(state)
    response.headers["ETag"] = etag(deployment.epoch)
    return deployment


@router.get("", response_model=list[Deployment])
def list_deployments(request: Request, _principal: Principal = Depends(require(*ANY_ROLE))) -> list[Deployment]:
    """Every deployment, by name."""
    with state_of(request).sessions() as session:
        preheated = preheated_digests(session)
        rows = session.scalars(select(DeploymentRow).order_by(DeploymentRow.name))
        return [to_schema(row, preheated.get(row.name, ())) for row in rows]


@router.get("/{name}", response_model=Deployment, responses=errors(404))
def get_deployment(
    name: str, request: Request, response: Response, _principal: Principal = Depends(require(*ANY_ROLE))
) -> Deployment:
    """One deployment; ``ETag`` carries its epoch for the next ``If-Match``."""
    with state_of(request).sessions() as session:
        deployment = to_schema(load_deployment(session, name), preheated_digests(session, name).get(name, ()))
    response.headers["ETag"] = etag(deployment.epoch)
    return deployment


@router.put("/{name}/pointer", response_model=Deployment, responses=errors(400, 404, 409, 412, 428))
async def set_pointer(
    name: str,
    body: PointerUpdate,
    request: Request,
    response: Response,
    if_match: IfMatch = None,
    principal: Principal = Depends(require(Role.operator)),
) -> Deployment:
    """Compare-and-swap the pointer: 428 without ``If-Match``, 412 when it is stale."""
    state = state_of(request)
    expected = parse_if_match(if_match, name)
    deployment = await run_in_threadpool(move_pointer, state, name, expected, body, principal.name)
    await notify_pointer_changed(state)
    response.headers["ETag"] = etag(deployment.epoch)
    return deployment


@router.post("/{name}/rollback", response_model=Deployment, responses=errors(400, 404, 409, 412))
async def rollback(
    name: str,
    request: Request,
    response: Response,
    body: RollbackRequest | None = None,
    if_match: IfMatch = None,
    principal: Principal = Depends(require(Role.operator)),
) -> Deployment:
    """Make the previous stable version (or ``to``) stable again, at a new epoch; drops any canary."""
    state = state_of(request)
    expected = parse_if_match(if_match, name) if if_match is not None else None
    deployment = await run_in_threadpool(roll_back, state, name, expected, body or RollbackRequest(), principal.name)
    await notify_pointer_changed(state)
    response.headers["ETag"] = etag(deployment.epoch)
    return deployment


@router.get("/{name}/history", response_model=list[PointerEvent], responses=errors(404))
def history(
    name: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before_epoch: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    _principal: Principal = Depends(require(*ANY_ROLE)),
) -> list[PointerEvent]:
    """Pointer changes, newest first; page with ``before_epoch``."""
    with state_of(request).sessions() as session:
        load_deployment(session, name)
        query = select(PointerEventRow).where(PointerEventRow.deployment == name)
        if before_epoch is not None:
            query = query.where(PointerEventRow.epoch < before_epoch)
        rows = session.scalars(query.order_by(PointerEventRow.epoch.desc()).limit(limit)).all()
        return [event_schema(row) for row in rows]
