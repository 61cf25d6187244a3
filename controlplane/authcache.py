"""The per-process cache of authenticated tokens, with prompt revocation.

Every request carries a bearer token; looking it up in the database on every request is one
query per heartbeat and per long-poll, which at fleet scale is most of the database's work.
So a successful lookup is remembered, keyed by the SHA-256 of the ``Authorization`` header (the
secret itself is never kept), for ``TTL_SECONDS``.

Revocation must not wait for the TTL. The revoking process drops the token from its own cache
before it answers, and announces ``token:<id>`` on the change feed (``controlplane.notify``),
which drops it in every other process within milliseconds. A reconnect of the feed clears the
cache (announcements may have been missed), and every ``RECHECK_SECONDS`` one query asks which
cached tokens are revoked, the backstop for an announcement that was never sent. So the TTL can
be long: with a token per node, a short one would make every node's requests miss the cache
every TTL. Failed lookups are not cached: a token minted a moment ago works at once.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.notify import RESYNC, token_topic
from controlplane.persistence.rows import TokenRow

__all__ = ["MAX_ENTRIES", "TTL_SECONDS", "TokenCache"]

#: how long an authenticated token is trusted without asking the database again
TTL_SECONDS = 300.0
#: tokens asked about per query when rechecking which cached ones are revoked
_RECHECK_BATCH = 900
#: beyond this many cached tokens the cache starts afresh (tokens are few; hostile input is not)
MAX_ENTRIES = 50_000

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class _Entry(Generic[P]):
    principal: P
    token_id: str
    expires: float


class TokenCache(Generic[P]):
    """Principals by ``Authorization`` header hash, each trusted for ``ttl`` seconds of ``clock``."""

    def __init__(self, ttl: float = TTL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._entries: dict[str, _Entry[P]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(header: str) -> str:
        """The cache key of an ``Authorization`` header."""
        return hashlib.sha256(header.encode("utf-8")).hexdigest()

    def get(self, header: str) -> P | None:
        """The cached principal behind ``header``, unless unknown or expired."""
        entry = self._entries.get(self.key(header))
        if entry is None or entry.expires <= self._clock():
            return None
        return entry.principal

    def put(self, header: str, principal: P, token_id: str) -> None:
        """Remember that ``header`` authenticates as ``principal`` (token ``token_id``)."""
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[self.key(header)] = _Entry(principal, token_id, self._clock() + self._ttl)

    def revoke(self, token_id: str) -> None:
        """Forget every header of token ``token_id``."""
        with self._lock:
            self._entries = {k: e for k, e in self._entries.items() if e.token_id != token_id}

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._entries.clear()

    def recheck(self, sessions: sessionmaker[Session]) -> None:
        """Forget every cached token that the database says is revoked (blocking: a worker thread)."""
        ids = sorted({entry.token_id for entry in list(self._entries.values())})
        for start in range(0, len(ids), _RECHECK_BATCH):
            batch = ids[start : start + _RECHECK_BATCH]
            with sessions() as session:
                revoked = session.scalars(select(TokenRow.id).where(TokenRow.id.in_(batch), TokenRow.revoked.is_(True)))
                for token_id in revoked.all():
                    self.revoke(token_id)

    def on_change(self, topic: str) -> None:
        """Change-feed listener: a revoked token is forgotten; a resync forgets everything."""
        if topic == RESYNC:
            self.clear()
        elif topic.startswith(token_topic("")):
            self.revoke(topic.removeprefix(token_topic("")))
