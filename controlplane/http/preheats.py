"""HTTP routes of preheats and warm pools (``controlplane.preheats``): stage versions on nodes without switching."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response, status
from starlette.concurrency import run_in_threadpool

from controlplane.auth import ANY_ROLE, Principal
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.preheats import announce_staging, cancel_preheat, create_preheat, list_preheats, set_warm_pool
from weightship.schemas import Deployment, Preheat, PreheatCreate, Role, WarmPool

__all__ = ["router"]

router = APIRouter(prefix="/v1/deployments", tags=["preheats"])


@router.post(
    "/{name}/preheats", status_code=status.HTTP_201_CREATED, response_model=Preheat, responses=errors(400, 404, 409)
)
async def preheat(
    name: str,
    body: PreheatCreate,
    request: Request,
    response: Response,
    principal: Principal = Depends(require(Role.operator)),
) -> Preheat:
    """Stage a ready version on the nodes ``selector`` matches, without switching (200: the same one stands)."""
    state = state_of(request)
    created, new = await run_in_threadpool(create_preheat, state, name, body, principal.name)
    if new:
        await announce_staging(state)
    else:
        response.status_code = status.HTTP_200_OK
    return created


@router.get("/{name}/preheats", response_model=list[Preheat], responses=errors(404))
async def preheats(name: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))) -> list[Preheat]:
    """The deployment's standing preheats with their progress (nodes matched, staged, fetching, failed)."""
    return await run_in_threadpool(list_preheats, state_of(request), name)


@router.delete(
    "/{name}/preheats/{preheat_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=errors(404),
)
async def cancel(
    name: str, preheat_id: str, request: Request, _principal: Principal = Depends(require(Role.operator))
) -> Response:
    """Cancel a preheat: nodes stop protecting the version (it ages out unless something else names it)."""
    state = state_of(request)
    await run_in_threadpool(cancel_preheat, state, name, preheat_id)
    await announce_staging(state)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put("/{name}/warm-pool", response_model=Deployment, responses=errors(400, 404))
async def put_warm_pool(
    name: str, body: WarmPool, request: Request, principal: Principal = Depends(require(Role.operator))
) -> Deployment:
    """Declare the deployment's warm pool: matching nodes keep its stable and canary versions staged."""
    state = state_of(request)
    deployment = await run_in_threadpool(set_warm_pool, state, name, body, principal.name)
    await announce_staging(state)
    return deployment


@router.delete("/{name}/warm-pool", response_model=Deployment, responses=errors(404))
async def delete_warm_pool(
    name: str, request: Request, principal: Principal = Depends(require(Role.operator))
) -> Deployment:
    """Drop the deployment's warm pool: its nodes stop protecting those versions (unless they serve them)."""
    state = state_of(request)
    deployment = await run_in_threadpool(set_warm_pool, state, name, None, principal.name)
    await announce_staging(state)
    return deployment
