"""Bearer-token authentication and role-based authorisation.

Tokens look like ``ws_<40 url-safe chars>``; only their SHA-256 is stored. Roles: ``publisher``
publishes versions, ``operator`` moves pointers, ``agent`` is a node daemon, ``admin`` may do
everything. Every ``/v1`` route declares the roles it admits with ``require(...)``. Successful
lookups are cached for a few seconds and dropped at once on revocation (``controlplane.authcache``).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from controlplane.authcache import token_cache_of
from controlplane.db import TokenRow
from weightship.errors import AuthError, ForbiddenError
from weightship.schemas import Role

__all__ = ["ANY_ROLE", "Principal", "authenticate", "hash_secret", "new_secret", "require"]

ANY_ROLE = frozenset(Role)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's name and role."""

    name: str
    role: Role
    token_id: str


def new_secret() -> str:
    """A fresh token secret."""
    return "ws_" + secrets.token_urlsafe(30)


def hash_secret(secret: str) -> str:
    """What is stored for a secret."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def authenticate(session: Session, header: str | None) -> Principal:
    """The principal behind an ``Authorization`` header, or ``AuthError``."""
    if not header:
        raise AuthError("missing Authorization header: send 'Authorization: Bearer <token>'")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthError("Authorization header must be 'Bearer <token>'")
    row = session.scalars(select(TokenRow).where(TokenRow.secret_hash == hash_secret(secret.strip()))).first()
    if row is None or row.revoked:
        raise AuthError("token is not valid (unknown or revoked): ask an admin for a new one")
    return Principal(name=row.name, role=Role(row.role), token_id=row.id)


def _authenticate(state: Any, header: str | None) -> Principal:
    with state.sessions() as session:
        return authenticate(session, header)


def require(*roles: Role) -> Callable[[Request], Awaitable[Principal]]:
    """FastAPI dependency admitting ``roles`` (and always ``admin``)."""
    allowed = frozenset(roles) | {Role.admin}

    async def dependency(request: Request) -> Principal:
        state = request.app.state.ws
        header = request.headers.get("authorization")
        cache = token_cache_of(state)
        principal: Principal | None = cache.get(header) if header else None
        if principal is None:
            principal = await run_in_threadpool(_authenticate, state, header)
            cache.put(header or "", principal, principal.token_id)
        if principal.role not in allowed:
            names = ", ".join(sorted(r.value for r in allowed))
            raise ForbiddenError(
                f"token {principal.name!r} has role {principal.role.value!r}; this call needs one of: {names}"
            )
        return principal

    return dependency
