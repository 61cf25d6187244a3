"""HTTP routes of entitlement tickets (``controlplane.tickets``): a node's own ticket, and the public keys."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from controlplane.auth import ANY_ROLE, Principal
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.tickets import issue_ticket, signing_key
from weightship.errors import ForbiddenError
from weightship.schemas import Role, TicketGrant, TicketKeys, TicketRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1/tickets", tags=["tickets"])


def _node_token(principal: Principal = Depends(require(Role.agent))) -> Principal:
    """A node token, and nothing else: not even an admin's, since a ticket must name a node."""
    if principal.role != Role.agent or principal.node_id is None:
        raise ForbiddenError(
            f"token {principal.name!r} is not a node token: tickets name the node they are issued to, so only "
            "a node's own node token (returned by POST /v1/nodes/enrol) can ask for one"
        )
    return principal


@router.post("", response_model=TicketGrant, responses=errors(404))
async def create_ticket(
    body: TicketRequest, request: Request, principal: Principal = Depends(_node_token)
) -> TicketGrant:
    """A ticket for the calling node itself (node token only), for versions it is entitled to."""
    assert principal.node_id is not None
    return await run_in_threadpool(
        functools.partial(issue_ticket, state_of(request), principal.node_id, body.versions, audience=body.audience)
    )


@router.get("/keys", response_model=TicketKeys)
async def ticket_keys(request: Request, _principal: Principal = Depends(require(*ANY_ROLE))) -> TicketKeys:
    """The public keys tickets are signed with (key id -> raw ed25519 key, base64url)."""
    keys = await run_in_threadpool(signing_key, state_of(request))
    return TicketKeys(keys=dict(keys.public))
