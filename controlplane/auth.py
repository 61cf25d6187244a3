"""Bearer-token authentication and role-based authorisation, and the node a token acts for.

Tokens look like ``ws_<40 url-safe chars>``; only their SHA-256 is stored. Roles: ``publisher``
publishes versions, ``operator`` moves pointers, ``agent`` is a node daemon, ``read`` reads (the
API's GET routes and the status page at ``/ui/``) and writes nothing, ``admin`` may do everything. Every ``/v1`` route declares the roles it admits with ``require(...)``.

**Node identity.** An ``agent`` token comes in two kinds:

- an *enrolment token* (``node_id`` empty), minted by an admin and handed to machines as they are
  provisioned: it may enrol a node (``POST /v1/nodes/enrol``, ``require_enrolment``) and nothing
  else: never act for one, nor read (``require`` refuses it everywhere). It may carry a scope
  (``TokenRow.deployments``, ``TokenRow.node_role``) that becomes what its nodes are assigned;
- a *node token*, minted by enrolment and bound to one node: it registers, heartbeats and reads
  desired state for that node only (``require_node``, ``ensure_acts_for``). Anything else is 403.

So a leaked node token speaks for one machine, and no agent token can re-register, silence or
impersonate another node.

Successful lookups are cached and dropped at once on revocation (``controlplane.authcache``).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence.rows import NodeRow, TokenRow
from weightship.errors import AuthError, ForbiddenError
from weightship.schemas import Role

__all__ = [
    "ANY_ROLE",
    "Principal",
    "authenticate",
    "authenticate_in",
    "ensure_acts_for",
    "hash_secret",
    "new_secret",
    "refuse_role",
]

ANY_ROLE = frozenset(Role)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's name and role, and for a node token the node it acts for."""

    name: str
    role: Role
    token_id: str
    node_id: str | None = None
    node_name: str | None = None

    @property
    def is_enrolment(self) -> bool:
        """An ``agent`` token bound to no node: it may only enrol one."""
        return self.role == Role.agent and self.node_id is None


def new_secret() -> str:
    """A fresh token secret."""
    return "ws_" + secrets.token_urlsafe(30)


def hash_secret(secret: str) -> str:
    """What is stored for a secret."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def authenticate(session: Session, header: str | None) -> Principal:
    """The principal behind an ``Authorization`` header, or ``AuthError``."""
    if not header:
        raise AuthError("missing Authorization header: send 'Authorization: Bearer <token>'", code="token_missing")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthError("Authorization header must be 'Bearer <token>'", code="token_malformed")
    found = session.execute(
        select(TokenRow, NodeRow.name)
        .outerjoin(NodeRow, NodeRow.id == TokenRow.node_id)
        .where(TokenRow.secret_hash == hash_secret(secret.strip()))
    ).first()
    if found is None or found[0].revoked:
        raise AuthError("token is not valid (unknown or revoked): ask an admin for a new one", code="token_invalid")
    row, node_name = found
    return Principal(name=row.name, role=Role(row.role), token_id=row.id, node_id=row.node_id, node_name=node_name)


def refuse_role(principal: Principal, allowed: frozenset[Role]) -> ForbiddenError:
    names = ", ".join(sorted(r.value for r in allowed))
    return ForbiddenError(
        f"token {principal.name!r} has role {principal.role.value!r}; this call needs one of: {names}",
        code="role_refused",
        fields={"token": principal.name, "role": principal.role.value, "roles_needed": names},
    )


def authenticate_in(sessions: sessionmaker[Session], header: str | None) -> Principal:
    """``authenticate`` in a session of its own."""
    with sessions() as session:
        return authenticate(session, header)


def ensure_acts_for(principal: Principal, *, node_id: str | None = None, name: str | None = None) -> None:
    """Refuse (403) unless ``principal`` may act for the node ``node_id`` / called ``name``.

    Admins may act for any node; an agent only with the node token of that very node.
    """
    if principal.role == Role.admin:
        return
    if principal.role != Role.agent:
        raise refuse_role(principal, frozenset({Role.agent, Role.admin}))
    if principal.node_id is None:
        raise ForbiddenError(
            f"token {principal.name!r} is an enrolment token: it can enrol a node (POST /v1/nodes/enrol) "
            "but not act for one; use the node token that enrolment returned",
            code="enrolment_token_cannot_act",
            fields={"token": principal.name},
        )
    if (node_id is not None and node_id != principal.node_id) or (name is not None and name != principal.node_name):
        asked = name if name is not None else node_id
        raise ForbiddenError(
            f"token {principal.name!r} is the node token of node {principal.node_name!r} "
            f"(id {principal.node_id}); it cannot act for node {asked!r}",
            code="other_node",
            fields={"token": principal.name, "node": principal.node_name, "node_asked": asked},
        )


