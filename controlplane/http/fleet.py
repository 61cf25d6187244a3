"""HTTP routes of the fleet (``controlplane.fleet``): enrolment, registration, heartbeats, desired state (long-poll), nodes, deployment status."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from controlplane.auth import ANY_ROLE, Principal, ensure_acts_for
from controlplane.fleet import (
    assign_deployment,
    assign_node,
    desired_answer,
    node_infos,
    record_heartbeat,
    register_node,
    status_of,
)
from controlplane.http import state_of
from controlplane.http.auth import require, require_enrolment, require_node
from controlplane.http.problems import errors
from controlplane.pacing import expiry
from controlplane.staging import with_stage
from controlplane.state import AppState
from weightship.schemas import (
    DeploymentAssignment,
    DeploymentStatus,
    DesiredState,
    NodeAssignment,
    NodeEnrolment,
    NodeEnrolRequest,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    Role,
)

__all__ = [
    "POLL_AFTER",
    "accept_heartbeat",
    "desired_answer_when_changed",
    "parse_heartbeat",
    "poll_after_value",
    "router",
]

#: response header of a desired-state answer: seconds the agent waits before its next long-poll
POLL_AFTER = "Poll-After"

nodes_router = APIRouter(prefix="/v1/nodes", tags=["fleet"])


status_router = APIRouter(prefix="/v1/deployments", tags=["fleet"])


router = APIRouter()


#: long-polls of at least this many seconds expire on their node's phase (``controlplane.pacing``)
_PHASED_FROM_SECONDS = 5.0


@nodes_router.post(
    "/enrol", status_code=status.HTTP_201_CREATED, response_model=NodeEnrolment, responses=errors(400, 409)
)
async def enrol(
    body: NodeEnrolRequest, request: Request, principal: Principal = Depends(require_enrolment())
) -> NodeEnrolment:
    """Enrol a node with an enrolment token: register it and return its node token, once (409 if enrolled)."""
    state = state_of(request)
    token_id = principal.token_id if principal.is_enrolment else None  # an admin enrols any role, unscoped
    enrolment = await run_in_threadpool(
        functools.partial(register_node, state, body, principal.name, token_id=token_id)
    )
    assert isinstance(enrolment, NodeEnrolment)
    state.metrics.node_registrations.inc()
    return enrolment


@nodes_router.post("/register", response_model=NodeInfo, responses=errors(400, 404, 409))
async def register(
    body: NodeRegistration, request: Request, principal: Principal = Depends(require_node(None))
) -> NodeInfo:
    """Re-register a node with its own node token (same id; labels and deployments replaced)."""
    ensure_acts_for(principal, name=body.name)
    state = state_of(request)
    info = await run_in_threadpool(functools.partial(register_node, state, body, trusted=principal.role == Role.admin))
    assert isinstance(info, NodeInfo)
    state.metrics.node_registrations.inc()
    return info


def _heartbeat_body() -> dict[str, Any]:
    # Documented by hand (the route reads its body itself): the schema's parts are those of
    # NodeInfo, already in the document's components.
    schema = NodeHeartbeat.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {"required": True, "content": {"application/json": {"schema": schema}}}


async def _body(request: Request) -> bytes:
    return await request.body()


@nodes_router.post(
    "/{node_id}/heartbeat",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=errors(404, 422),
    openapi_extra={"requestBody": _heartbeat_body()},
)
async def heartbeat(
    node_id: str,
    request: Request,
    raw: bytes = Depends(_body),
    principal: Principal = Depends(require_node()),
) -> Response:
    """Store a node's report and mark it seen."""
    # The body is read before the caller is checked (413 first, as for any route) and validated
    # after it (the same 422 problem FastAPI gives).
    try:
        body = parse_heartbeat(raw)
    except ValidationError as err:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in err.errors(include_url=False, include_context=False)]
        ) from None
    await accept_heartbeat(state_of(request), node_id, principal, body, raw)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def parse_heartbeat(raw: bytes) -> NodeHeartbeat:
    """The heartbeat in ``raw``, validated straight from its bytes (pydantic's JSON parser: half the
    cost of parse-then-validate); raises ``pydantic.ValidationError``."""
    return NodeHeartbeat.model_validate_json(raw)


async def accept_heartbeat(
    state: AppState, node_id: str, principal: Principal, body: NodeHeartbeat, raw: bytes
) -> None:
    """Record ``body`` (sent as ``raw``) for node ``node_id``, on behalf of ``principal``, who may act for it."""
    await record_heartbeat(state, node_id, principal.node_name or node_id, body, raw)
    state.metrics.heartbeats.inc()


@nodes_router.get("/{node_id}/desired", response_model=DesiredState, responses=errors(404))
async def desired(
    node_id: str,
    request: Request,
    after: Annotated[str | None, Query(max_length=128)] = None,
    wait: Annotated[float, Query(ge=0, le=3600)] = 0.0,
    _principal: Principal = Depends(require_node()),
) -> Response:
    """The node's desired state; with ``after`` and ``wait``, held until its revision differs from ``after``.

    A wait of 5 s or more ends on the node's phase of the window, so it may be shorter than asked
    (``controlplane.pacing``). An answer with news may carry ``Poll-After: SECONDS``: ask again after that.
    """
    body, delay = await desired_answer_when_changed(state_of(request), node_id, after, wait)
    headers = {POLL_AFTER: poll_after_value(delay)} if delay else None
    return Response(body, media_type="application/json", headers=headers)


def poll_after_value(delay: float) -> str:
    """The ``Poll-After`` header's value for ``delay`` seconds."""
    return f"{delay:.3f}"


async def desired_answer_when_changed(
    state: AppState, node_id: str, after: str | None, wait: float
) -> tuple[bytes, float]:
    """The desired state (JSON) of node ``node_id`` once its revision differs from ``after`` or
    ``wait`` has passed, and the seconds its agent should wait before asking again (0: at once)."""
    loop = asyncio.get_running_loop()
    waited = min(wait, state.settings.long_poll_max_seconds)
    if waited >= _PHASED_FROM_SECONDS:
        # Polls answered together (by a pointer change) would otherwise all time out and come
        # back together too, every time: each ends on its node's phase of the window instead.
        waited = expiry(node_id, time.time(), waited)
    deadline = loop.time() + waited
    snapshots = state.snapshots
    # A plain read (no ``after``: an agent that just started or re-registered, or a person) reads
    # the database, so it shows what is committed; long-polls use the snapshot and cost no query.
    fresh = after is None
    name, names = await snapshots.node(node_id, fresh=fresh)
    await snapshots.ensure(names, fresh=fresh)
    await snapshots.ensure_staging(fresh=fresh)
    gauge = state.metrics.long_polls_waiting
    while True:
        # Watch before computing: nothing can change between the two (no await), so no wake is lost.
        changed = snapshots.watch(names, node_id)
        try:
            revision, members = with_stage(
                *desired_answer(state, name, snapshots.rows(names)), snapshots.stage(node_id)
            )
            remaining = deadline - loop.time()
            if after is None or revision != after or remaining <= 0 or snapshots.draining:
                body = b'{"node_id":%s,"revision":"%s",%s}' % (
                    json.dumps(node_id).encode(),
                    revision.encode(),
                    members,
                )
                # News for a long-poll: ask the agent back later when many polls heard it at once.
                delay = snapshots.waker.poll_after() if after is not None and revision != after else 0.0
                return body, delay
            gauge.inc()
            try:
                await asyncio.wait((changed,), timeout=remaining)
            finally:
                gauge.dec()
        finally:
            snapshots.unwatch(names, changed, node_id)


@nodes_router.get("", response_model=list[NodeInfo])
async def list_nodes(
    request: Request,
    deployment: Annotated[str | None, Query(max_length=128)] = None,
    _principal: Principal = Depends(require(*ANY_ROLE)),
) -> list[NodeInfo]:
    """Every registered node (optionally only those serving ``deployment``), with its stale flag."""
    return await run_in_threadpool(node_infos, state_of(request), deployment)


@nodes_router.put("/{node_id}/assignment", response_model=NodeInfo, responses=errors(404))
async def assign(
    node_id: str, body: NodeAssignment, request: Request, principal: Principal = Depends(require(Role.operator))
) -> NodeInfo:
    """Set the deployments a node is assigned (null: all): what its tickets and blob URLs follow (operator)."""
    return await run_in_threadpool(assign_node, state_of(request), node_id, body.deployments, principal.name)


@status_router.put("/{name}/assignment", response_model=DeploymentAssignment, responses=errors(400, 404))
async def assign_by_selector(
    name: str, body: DeploymentAssignment, request: Request, principal: Principal = Depends(require(Role.operator))
) -> DeploymentAssignment:
    """Assign the deployment to the nodes whose enrolled labels match ``selector`` (null: none) (operator)."""
    return await run_in_threadpool(assign_deployment, state_of(request), name, body.selector, principal.name)


@status_router.get("/{name}/status", response_model=DeploymentStatus, responses=errors(404))
async def deployment_status(
    name: str, request: Request, _principal: Principal = Depends(require(*ANY_ROLE))
) -> DeploymentStatus:
    """How each version of a deployment stands across the fleet's live nodes."""
    return await run_in_threadpool(status_of, state_of(request), name)


router.include_router(nodes_router)


router.include_router(status_router)
