"""HTTP routes of rollouts (``controlplane.rollout_resources``): create, read, list, verbs.

The contract (shared with the CLI) is in ``docs/api.md``; the fleet driver that moves rollouts
forward (``controlplane.rollout_driver``) is woken through the change feed after a create or a verb.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, status
from pydantic import StringConstraints
from starlette.concurrency import run_in_threadpool

from controlplane.auth import ANY_ROLE, Principal
from controlplane.fleet import node_infos
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.rollout_driver import FleetRolloutDriver
from controlplane.rollout_resources import ROLLOUTS, apply_verb, create_rollout, get_rollout, list_rollouts
from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers.base import RolloutContext
from controlplane.rollouts.providers.builtin import BuiltinProvider
from weightship.schemas import (
    BuiltinMeasure,
    BuiltinMeasurement,
    NodeLoads,
    Role,
    Rollout,
    RolloutAction,
    RolloutCreate,
    RolloutList,
    VersionLoads,
)

__all__ = ["router"]

router = APIRouter(tags=["rollouts"])

Limit = Annotated[int, Query(ge=1, le=1000)]
DigestQuery = Annotated[str, Query(), StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]


def _driver(request: Request) -> FleetRolloutDriver:
    driver = state_of(request).rollouts
    assert driver is not None, "the application's lifespan sets AppState.rollouts"
    return driver


@router.post(
    "/v1/deployments/{name}/rollouts",
    status_code=status.HTTP_201_CREATED,
    response_model=Rollout,
    responses=errors(404, 409, 422),
)
async def start_rollout(
    name: str,
    body: RolloutCreate,
    request: Request,
    principal: Principal = Depends(require(Role.operator, Role.publisher)),
) -> Rollout:
    """Start a rollout of ``spec.version``; 409 ``rollout_active`` if one is active, 422 for a bad spec."""
    state = state_of(request)
    rollout = await run_in_threadpool(create_rollout, state, name, body, principal, _driver(request).check_spec)
    await state.changes.announce(ROLLOUTS)  # wakes the drivers of every process
    return rollout


@router.get("/v1/deployments/{name}/rollouts", response_model=RolloutList, responses=errors(404))
def deployment_rollouts(
    name: str, request: Request, limit: Limit = 100, _principal: Principal = Depends(require(*ANY_ROLE))
) -> RolloutList:
    """The deployment's rollouts, newest first."""
    return RolloutList(rollouts=list_rollouts(state_of(request), name, active=False, limit=limit))


@router.get("/v1/rollouts", response_model=RolloutList)
def all_rollouts(
    request: Request,
    active: bool = False,
    limit: Limit = 100,
    _principal: Principal = Depends(require(*ANY_ROLE)),
) -> RolloutList:
    """Rollouts of every deployment, newest first; ``active=true``: only the active ones."""
    return RolloutList(rollouts=list_rollouts(state_of(request), None, active=active, limit=limit))


@router.get("/v1/deployments/{name}/rollouts/{rollout_id}", response_model=Rollout, responses=errors(404))
def one_rollout(
    name: str, rollout_id: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> Rollout:
    """One rollout; ``current`` names the active one, else the latest."""
    return get_rollout(state_of(request), name, rollout_id)


@router.post("/v1/deployments/{name}/rollouts/{rollout_id}/actions", response_model=Rollout, responses=errors(404, 409))
async def rollout_action(
    name: str,
    rollout_id: str,
    body: RolloutAction,
    request: Request,
    principal: Principal = Depends(require(Role.operator)),
) -> Rollout:
    """Apply a verb; 409 ``rollout_verb`` when it does not fit the rollout's state (the message says what does)."""
    state = state_of(request)
    rollout = await run_in_threadpool(apply_verb, state, name, rollout_id, body.verb, principal)
    await state.changes.announce(ROLLOUTS)
    return rollout


@router.post(
    "/v1/deployments/{name}/analysis/builtin", response_model=BuiltinMeasurement, responses=errors(400, 503)
)
async def measure_builtin(
    name: str,
    body: BuiltinMeasure,
    request: Request,
    _principal: Principal = Depends(require(Role.operator)),
) -> BuiltinMeasurement:
    """One built-in measurement of ``canary`` against ``stable`` for a rollout driven elsewhere (the Kubernetes operator)."""
    provider = BuiltinProvider.for_state(state_of(request))
    action = MeasureMetric("remote", body.metric, 0, "builtin", body.provider)
    value = await provider.measure(action, RolloutContext("remote", name, body.canary, body.stable))
    return BuiltinMeasurement(value=value)


@router.get("/v1/deployments/{name}/analysis/loads", response_model=VersionLoads)
def version_loads(
    name: str, digest: DigestQuery, request: Request, _principal: Principal = Depends(require(Role.operator))
) -> VersionLoads:
    """How the live nodes' model servers fared loading ``digest`` for ``name``: loaded, and failed loads so far.

    Every live node counts, assigned to the deployment or not (a Kubernetes node's agent serves the
    pods scheduled on it); a node whose model servers report nothing of ``digest`` is left out.
    """
    found: list[NodeLoads] = []
    for node in node_infos(state_of(request), None):
        if node.stale or node.serve is None:
            continue
        mine = next((v for v in node.serve.versions if v.deployment == name and v.digest == digest), None)
        if mine is None:
            continue
        loaded = mine.validations_passed > 0 or mine.requests > 0
        found.append(NodeLoads(node=node.name, loaded=loaded, failures=mine.validations_failed + mine.load_failures))
    return VersionLoads(digest=digest, nodes=found)
