"""Browser sessions of the status page: an opaque random id in a cookie, the principal held server-side.

A person enters an API token once, on the login form; the control plane checks it exactly as the
API does (``controlplane.auth``) and keeps the resulting ``Principal`` here, under a fresh random
session id. The browser only ever holds that id, in an ``HttpOnly``, ``SameSite=Strict`` cookie
scoped to ``/ui/``: the token itself is never sent back, never put in a URL, never readable by
the page's script. A session ends when it expires (``SESSION_SECONDS`` after login), on logout, or
at once when its token is revoked (the change feed announces ``token:<id>``, see
``controlplane.notify``).

Sessions live in the memory of the process that logged the person in: a control plane run as
several replicas needs sticky sessions for ``/ui/`` (or a person logs in again on another
replica). A restart logs everyone out, which is the safe direction.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.auth import Principal
from controlplane.notify import RESYNC, token_topic

__all__ = ["COOKIE", "MAX_SESSIONS", "SESSION_SECONDS", "Session", "SessionStore"]

#: the cookie that carries the session id
COOKIE = "weightship_ui"
#: how long a login lasts
SESSION_SECONDS = 12 * 3600.0
#: beyond this many live sessions the oldest are dropped (each login makes one)
MAX_SESSIONS = 10_000


@dataclass(frozen=True, slots=True)
class Session:
    """One logged-in browser: who it is and until when."""

    id: str
    principal: Principal
    expires: float


class SessionStore:
    """Sessions of this process, by opaque id; ``on_change`` listens to the change feed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, lifetime: float = SESSION_SECONDS) -> None:
        self._clock = clock
        self._lifetime = lifetime
        self._sessions: dict[str, Session] = {}

    def create(self, principal: Principal) -> Session:
        """A new session for ``principal`` (already authenticated)."""
        self._expire()
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        session = Session(secrets.token_urlsafe(32), principal, self._clock() + self._lifetime)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session ``session_id`` names, or ``None`` (unknown, expired or revoked)."""
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if session.expires <= self._clock():
            del self._sessions[session_id]
            return None
        return session

    def end(self, session_id: str | None) -> None:
        """Log out: forget ``session_id``."""
        if session_id:
            self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def on_change(self, topic: str) -> bool:
        """Change-feed listener: a revoked token ends its sessions at once; whether any ended."""
        if topic == RESYNC or not topic.startswith(token_topic("")):
            return False
        token_id = topic.removeprefix(token_topic(""))
        ended = [s.id for s in self._sessions.values() if s.principal.token_id == token_id]
        for sid in ended:
            del self._sessions[sid]
        return bool(ended)

    def _expire(self) -> None:
        now = self._clock()
        for sid in [s.id for s in self._sessions.values() if s.expires <= now]:
            del self._sessions[sid]
