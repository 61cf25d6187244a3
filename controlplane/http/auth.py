"""FastAPI dependencies that authenticate the caller and admit roles (``controlplane.auth`` holds the rules).

Every ``/v1`` route declares the roles it admits with ``require(...)``; node routes use
``require_node`` and enrolment ``require_enrolment``. An enrolment token (an ``agent`` token bound
to no node) passes ``require_enrolment`` only: every other route refuses it (403). The caller is looked up in the process's
token cache first (``controlplane.authcache``), then in the database off the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from controlplane.auth import Principal, authenticate_in, ensure_acts_for, refuse_role
from controlplane.http import state_of
from weightship.errors import ForbiddenError
from weightship.schemas import Role

__all__ = ["require", "require_enrolment", "require_node"]


async def _principal(request: Request) -> Principal:
    """The caller, from the token cache or (on a miss) the database, off the event loop."""
    state = state_of(request)
    header = request.headers.get("authorization")
    cache = state.tokens
    principal: Principal | None = cache.get(header) if header else None
    if principal is None:
        principal = await run_in_threadpool(authenticate_in, state.sessions, header)
        cache.put(header or "", principal, principal.token_id)
    return principal


def require(*roles: Role) -> Callable[[Request], Awaitable[Principal]]:
    """FastAPI dependency admitting ``roles`` (and always ``admin``)."""
    allowed = frozenset(roles) | {Role.admin}

    async def dependency(request: Request) -> Principal:
        principal = await _principal(request)
        if principal.role not in allowed:
            raise refuse_role(principal, allowed)
        if principal.is_enrolment:
            raise ForbiddenError(
                f"token {principal.name!r} is an enrolment token: it can enrol a node (POST /v1/nodes/enrol) and "
                "nothing else; use the node token that enrolment returned",
                code="enrolment_token_cannot_act",
                fields={"token": principal.name},
            )
        return principal

    return dependency


def require_node(param: str | None = "node_id") -> Callable[[Request], Awaitable[Principal]]:
    """FastAPI dependency: ``admin``, or the node token of the node named by path parameter ``param``.

    With ``param=None`` any node token passes; the route then checks the node it names in its body
    with ``ensure_acts_for``.
    """

    async def dependency(request: Request) -> Principal:
        principal = await _principal(request)
        ensure_acts_for(principal, node_id=None if param is None else request.path_params[param])
        return principal

    return dependency


def require_enrolment() -> Callable[[Request], Awaitable[Principal]]:
    """FastAPI dependency: ``admin``, or an enrolment token (an ``agent`` token bound to no node)."""

    async def dependency(request: Request) -> Principal:
        principal = await _principal(request)
        if principal.role == Role.admin or principal.is_enrolment:
            return principal
        if principal.role == Role.agent:
            raise ForbiddenError(
                f"token {principal.name!r} is already the node token of node {principal.node_name!r}: "
                "that node re-registers with POST /v1/nodes/register; enrolling needs an enrolment token"
            )
        raise refuse_role(principal, frozenset({Role.agent, Role.admin}))

    return dependency
