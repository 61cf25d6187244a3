"""API tokens: minting, listing and revoking them, and the bootstrap admin token.

A token's secret is shown once, when it is minted; only its SHA-256 is stored
(``controlplane.auth.hash_secret``). Revoking marks the row ``revoked`` instead of deleting it, so
the audit trail (``created_by`` of later tokens, pointer events naming the actor) still resolves.

The bootstrap admin token comes from ``WEIGHTSHIP_ADMIN_TOKEN``. At start-up its hash is stored
as an ``admin`` token named ``bootstrap-admin`` unless that hash is already known, so restarts and
replicas starting together are harmless. A bootstrap token that an admin revoked stays revoked:
restarting with the same environment never brings it back.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import APIRouter, Depends, Request, Response, status
from sqlalchemy import exc, select, update

from controlplane.auth import Principal, hash_secret, new_secret, require
from controlplane.authcache import announce_revoked
from controlplane.db import TokenRow, utcnow
from weightship.errors import NotFoundError
from weightship.schemas import Role, TokenCreate, TokenCreated, TokenInfo

__all__ = ["BOOTSTRAP_NAME", "bootstrap_admin", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])

BOOTSTRAP_NAME = "bootstrap-admin"
_MIN_BOOTSTRAP_LENGTH = 16


def _new_id() -> str:
    return secrets.token_hex(8)


def bootstrap_admin(state: Any) -> None:
    """Store the hash of ``settings.admin_token`` as an admin token, once; nothing when it is empty."""
    secret: str = state.settings.admin_token
    if not secret:
        return
    if len(secret) < _MIN_BOOTSTRAP_LENGTH:
        # Warn rather than refuse: local demos use short tokens; production should not.
        log.warning(
            "bootstrap_admin_weak length=%d advice=use_at_least_%d_random_chars", len(secret), _MIN_BOOTSTRAP_LENGTH
        )
    digest = hash_secret(secret)
    with state.sessions() as session:
        existing = session.scalars(select(TokenRow).where(TokenRow.secret_hash == digest)).first()
        if existing is not None:
            if existing.revoked:
                log.warning("bootstrap_admin_revoked token_id=%s action=left_revoked", existing.id)
            return
        session.add(
            TokenRow(
                id=_new_id(),
                name=BOOTSTRAP_NAME,
                role=Role.admin.value,
                secret_hash=digest,
                revoked=False,
                created_at=utcnow(),
                created_by="bootstrap",
            )
        )
        try:
            session.commit()
        except exc.IntegrityError:
            # Another replica stored the same hash first: the outcome we wanted.
            session.rollback()
            return
    log.info("bootstrap_admin_stored name=%s", BOOTSTRAP_NAME)


def _info(row: TokenRow) -> TokenInfo:
    return TokenInfo(
        id=row.id, name=row.name, role=Role(row.role), created_at=row.created_at, created_by=row.created_by
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(
    body: TokenCreate, request: Request, principal: Principal = Depends(require(Role.admin))
) -> TokenCreated:
    """Mint a token for a role; the secret is in this response only."""
    secret = new_secret()
    row = TokenRow(
        id=_new_id(),
        name=body.name,
        role=body.role.value,
        secret_hash=hash_secret(secret),
        revoked=False,
        created_at=utcnow(),
        created_by=principal.name,
    )
    with request.app.state.ws.sessions() as session:
        session.add(row)
        session.commit()
    log.info("token_created token_id=%s name=%r role=%s by=%s", row.id, row.name, row.role, principal.name)
    return TokenCreated(id=row.id, name=row.name, role=body.role, token=secret)


@router.get("", response_model=list[TokenInfo])
def list_tokens(request: Request, _principal: Principal = Depends(require(Role.admin))) -> list[TokenInfo]:
    """Every token that is not revoked, oldest first, without secrets."""
    with request.app.state.ws.sessions() as session:
        rows = session.scalars(
            select(TokenRow).where(TokenRow.revoked.is_(False)).order_by(TokenRow.created_at, TokenRow.id)
        ).all()
        return [_info(row) for row in rows]


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def revoke_token(token_id: str, request: Request, principal: Principal = Depends(require(Role.admin))) -> Response:
    """Revoke a token: it stops working on the next request."""
    with request.app.state.ws.sessions() as session:
        result = session.execute(
            update(TokenRow).where(TokenRow.id == token_id, TokenRow.revoked.is_(False)).values(revoked=True)
        )
        session.commit()
    if getattr(result, "rowcount", 0) == 0:
        raise NotFoundError(f"no active token with id {token_id!r}; list tokens with GET /v1/tokens")
    announce_revoked(request.app.state.ws, token_id)
    log.info("token_revoked token_id=%s by=%s", token_id, principal.name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
