"""Routes of the status page under ``/ui/``: login form, the page, its event stream, node pages, static files.

Nothing but the login form (and the static script, styles and chart library) is served without a
session (``controlplane.ui.sessions``). The token posted by the form is checked exactly as the
API checks a bearer token (``controlplane.auth.authenticate``, the same roles): every role that
may read the API may see the page, an enrolment token may not. Nothing here writes.

``GET /ui/events`` is a server-sent-events stream: ``summary`` events carry the rendered sections
and chart series from the process's one ``Hub`` (``controlplane.ui.hub``), ``logout`` ends a
session that expired or whose token was revoked, and a comment every ``KEEPALIVE_SECONDS``
keeps proxies from closing a quiet stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.staticfiles import StaticFiles

from controlplane.auth import Principal, authenticate_in
from controlplane.http import state_of
from controlplane.persistence.rows import TokenRow
from controlplane.state import AppState
from controlplane.ui.hub import Hub
from controlplane.ui.page import login_page, status_page
from controlplane.ui.render import NODE_FILTERS, render_nodes
from controlplane.ui.sessions import COOKIE, SESSION_SECONDS, Session, SessionStore
from weightship.errors import AuthError

__all__ = ["KEEPALIVE_SECONDS", "UiState", "install", "router", "ui_of"]

#: a comment is sent on a quiet stream this often
KEEPALIVE_SECONDS = 15.0
STATIC = Path(__file__).parent / "static"
_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


@dataclass
class UiState:
    """The page's per-process parts: its broadcaster and its sessions."""

    hub: Hub
    sessions: SessionStore


def ui_of(request: Request) -> UiState:
    """This process's ``UiState``, made (and subscribed to the change feed) on the first visit."""
    found = getattr(request.app.state, "ui", None)
    if isinstance(found, UiState):
        return found
    state = state_of(request)
    ui = UiState(Hub(state), SessionStore())
    state.changes.subscribe(ui.hub.on_change)

    def revoked(topic: str) -> None:
        if ui.sessions.on_change(topic):
            ui.hub.wake()  # streams look at their session again and sign out

    state.changes.subscribe(revoked)
    request.app.state.ui = ui
    return ui


def _token_live(state: AppState, principal: Principal) -> bool:
    """The session's token is still valid (the backstop for a revocation announcement lost in transit)."""
    with state.sessions() as session:
        revoked = session.scalar(select(TokenRow.revoked).where(TokenRow.id == principal.token_id))
    return revoked is False


async def _session(request: Request, *, check_token: bool) -> Session | None:
    ui = ui_of(request)
    found = ui.sessions.get(request.cookies.get(COOKIE))
    if found is not None and check_token and not await run_in_threadpool(_token_live, state_of(request), found.principal):
        ui.sessions.end(found.id)
        return None
    return found


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


@router.get("")
async def bare() -> RedirectResponse:
    """``/ui`` is ``/ui/``."""
    return RedirectResponse("/ui/", status_code=308)


@router.get("/")
async def page(request: Request) -> HTMLResponse:
    """The status page, or the login form without a session."""
    found = await _session(request, check_token=True)
    if found is None:
        return _html(login_page())
    summary = await ui_of(request).hub.current()
    return _html(status_page(summary, found.principal))


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the posted token as the API would; on success start a session (cookie) and go to the page."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    state = state_of(request)
    try:
        principal = await run_in_threadpool(authenticate_in, state.sessions, f"Bearer {token}" if token else None)
    except AuthError as exc:
        return _html(login_page(exc.message), status=401)
    if principal.is_enrolment:
        return _html(login_page(f"token {principal.name!r} is an enrolment token: it can only enrol nodes; sign in with a token that may read the API"), status=403)
    created = ui_of(request).sessions.create(principal)
    response = RedirectResponse("/ui/", status_code=303, headers={"Cache-Control": "no-store"})
    response.set_cookie(
        COOKIE,
        created.id,
        max_age=int(SESSION_SECONDS),
        path="/ui",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """End the session."""
    ui_of(request).sessions.end(request.cookies.get(COOKIE))
    response = RedirectResponse("/ui/", status_code=303, headers={"Cache-Control": "no-store"})
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


@router.get("/nodes")
async def nodes(request: Request, page: int = 1, filter: str = "all", q: str = "") -> HTMLResponse:
    """One page of the node list, from the summary held (no query)."""
    if await _session(request, check_token=False) is None:
        return _html('<p class="error">signed out: reload the page to sign in again</p>', status=401)
    kind = filter if filter in NODE_FILTERS else "all"
    summary = await ui_of(request).hub.current()
    return _html(render_nodes(summary, page, kind, q[:128]))


@router.get("/events")
async def events(request: Request) -> Response:
    """The live stream: ``summary`` events whenever what the page shows changed."""
    found = await _session(request, check_token=True)
    if found is None:
        return Response("event: logout\ndata: {}\n\n", status_code=401, media_type="text/event-stream")
    ui = ui_of(request)

    async def stream() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        async for payload in ui.hub.updates(KEEPALIVE_SECONDS):
            if ui.sessions.get(found.id) is None:
                yield "event: logout\ndata: {}\n\n"
                return
            yield ": keepalive\n\n" if payload is None else f"event: summary\ndata: {payload}\n\n"

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def install(app: FastAPI) -> None:
    """Serve the status page on ``app`` under ``/ui/``."""
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
