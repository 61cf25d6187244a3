"""HTTP routes of API tokens (``controlplane.tokens``): mint, list, inspect and revoke."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request, Response, status
from sqlalchemy import select, update

from controlplane.auth import ANY_ROLE, Principal, new_secret
from controlplane.http import state_of
from controlplane.http.auth import require
from controlplane.http.problems import errors
from controlplane.persistence.rows import TokenRow
from controlplane.tokens import announce_revoked, new_token_row, token_info
from weightship.errors import NotFoundError, ValidationError
from weightship.logs import event
from weightship.schemas import Role, TokenCreate, TokenCreated, TokenInfo

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(
    body: TokenCreate, request: Request, principal: Principal = Depends(require(Role.admin))
) -> TokenCreated:
    """Mint a token for a role; the secret is in this response only."""
    if (body.deployments is not None or body.node_role is not None) and body.role != Role.agent:
        raise ValidationError(
            f"deployments and node_role scope an enrolment token (role agent), not a {body.role.value} token: "
            "drop them, or mint an agent token",
            code="scope_needs_agent",
        )
    secret = new_secret()
    row = new_token_row(body.name, body.role, secret, principal.name)
    row.deployments = None if body.deployments is None else list(dict.fromkeys(body.deployments))
    row.node_role = body.node_role
    with state_of(request).sessions() as session:
        session.add(row)
        session.commit()
    event(
        log,
        "token.created",
        token_id=row.id,
        name=row.name,
        role=row.role,
        deployments=row.deployments,
        node_role=row.node_role,
        by=principal.name,
    )
    return TokenCreated(id=row.id, name=row.name, role=body.role, token=secret)


@router.get("", response_model=list[TokenInfo])
def list_tokens(request: Request, _principal: Principal = Depends(require(Role.admin))) -> list[TokenInfo]:
    """Every token that is not revoked, oldest first, without secrets."""
    with state_of(request).sessions() as session:
        rows = session.scalars(
            select(TokenRow).where(TokenRow.revoked.is_(False)).order_by(TokenRow.created_at, TokenRow.id)
        ).all()
        return [token_info(row) for row in rows]


@router.get("/self", response_model=TokenInfo, responses=errors(404))
def who_am_i(request: Request, principal: Principal = Depends(require(*ANY_ROLE))) -> TokenInfo:
    """The caller's own token (any role): lets a client check URL, token and role before long work."""
    with state_of(request).sessions() as session:
        row = session.get(TokenRow, principal.token_id)
    if row is None:  # revoked and deleted between the two reads; tokens are never deleted today
        raise NotFoundError(f"token {principal.token_id!r} no longer exists; ask an admin for a new one")
    return token_info(row)


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response, responses=errors(404))
def revoke_token(token_id: str, request: Request, principal: Principal = Depends(require(Role.admin))) -> Response:
    """Revoke a token: it stops working on the next request."""
    with state_of(request).sessions() as session:
        result = session.execute(
            update(TokenRow).where(TokenRow.id == token_id, TokenRow.revoked.is_(False)).values(revoked=True)
        )
        session.commit()
    if getattr(result, "rowcount", 0) == 0:
        raise NotFoundError(f"no active token with id {token_id!r}; list tokens with GET /v1/tokens")
    announce_revoked(state_of(request), token_id)
    event(log, "token.revoked", token_id=token_id, by=principal.name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
