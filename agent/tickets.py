"""The agent's side of entitlement: the control plane's public keys, and this node's own ticket.

Two jobs, both offline on the hot path:

- **Checking** tickets that requesters present to this agent's peer listener: with the public
  keys learnt from the control plane (``GET /v1/tickets/keys``, and every grant). A ticket signed
  by a key this agent does not know yet triggers one re-read of the keys, at most every
  ``KEY_REFRESH_SECONDS``, so a rotation is picked up without letting forged key ids make it call
  the control plane per request.
- **Holding** this node's own ticket for the versions it fetches from peers and caches (a cache:
  every version a pointer names). ``ticket_for(versions)`` returns a held ticket when it covers
  them and is not past half its life; otherwise it asks the control plane for one naming what is
  asked (renewal at half-life, so a ticket never expires in flight). If renewal fails while the
  held ticket still covers them and is in date, the held one is used and renewal retried next time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from weightship.errors import TemporaryError, WeightshipError
from weightship.logs import event
from weightship.schemas import TicketGrant, TicketKeys
from weightship.tickets import Ticket, TicketInvalid, load_public_key, ticket_from_header, verify_ticket

__all__ = ["KEY_REFRESH_SECONDS", "TicketKeeper", "TicketSource"]

log = logging.getLogger("agent.tickets")

#: least time between two re-reads of the keys caused by an unknown key id
KEY_REFRESH_SECONDS = 30.0


class TicketSource(Protocol):
    """Where tickets and keys come from: the control plane (``ControlPlaneClient``)."""

    async def ticket(self, versions: list[str]) -> TicketGrant:
        """A ticket naming this node and ``versions``."""

    async def ticket_keys(self) -> TicketKeys:
        """The public keys tickets are signed with."""


class TicketKeeper:
    """Public keys for checking tickets, and this node's own ticket (renewed at half-life)."""

    def __init__(self, source: TicketSource, clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self.clock = clock
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._keys_read = float("-inf")
        self._grant: TicketGrant | None = None
        self._issued_at = 0.0
        self._lock = asyncio.Lock()

    # --- checking others' tickets --------------------------------------------------------------

    def learn_keys(self, keys: dict[str, str]) -> None:
        """Add the keys of a ``TicketKeys`` or ``TicketGrant`` answer (and forget retired ones)."""
        self._keys = {kid: load_public_key(text) for kid, text in keys.items()}
        self._keys_read = time.monotonic()

    async def refresh_keys(self) -> None:
        """Re-read the keys from the control plane."""
        self.learn_keys((await self.source.ticket_keys()).keys)
        event(log, "tickets.keys_read", keys=",".join(sorted(self._keys)))

    async def check(self, header: str | None, version: str) -> Ticket:
        """The ticket in ``header`` if it is genuine, in date and covers ``version``; else a ``Ticket*`` error."""
        token = ticket_from_header(header)
        try:
            ticket = verify_ticket(token, self._keys, self.clock())
        except TicketInvalid:
            if not await self._maybe_refresh():
                raise
            ticket = verify_ticket(token, self._keys, self.clock())
        ticket.require(version)
        return ticket

    async def _maybe_refresh(self) -> bool:
        if time.monotonic() - self._keys_read < KEY_REFRESH_SECONDS:
            return False
        self._keys_read = time.monotonic()  # before the call: a failing control plane is not hammered
        try:
            await self.refresh_keys()
        except WeightshipError as exc:
            event(log, "tickets.keys_unavailable", logging.WARNING, error=exc.message)
            return False
        return True

    # --- holding our own -----------------------------------------------------------------------

    def _fresh(self, wanted: set[str]) -> bool:
        grant = self._grant
        if grant is None or not wanted <= set(grant.versions):
            return False
        lifetime = grant.expires_at.timestamp() - self._issued_at
        return self.clock() < self._issued_at + lifetime / 2

    async def ticket_for(self, versions: Iterable[str]) -> str:
        """A ticket covering ``versions``, from the cache or freshly issued (``ForbiddenError`` if not entitled)."""
        wanted = set(versions)
        async with self._lock:
            if not self._fresh(wanted):
                try:
                    grant = await self.source.ticket(sorted(wanted))
                except WeightshipError as exc:
                    if (
                        self._grant is not None
                        and wanted <= set(self._grant.versions)
                        and (self._grant.expires_at.timestamp() > self.clock())
                    ):
                        # Renewal failed but the held ticket is still valid: use it, retry next time.
                        event(log, "tickets.renewal_failed", logging.WARNING, error=exc.message)
                        return self._grant.ticket
                    raise
                self._grant, self._issued_at = grant, self.clock()
                self.learn_keys(grant.keys)
                event(log, "tickets.issued", versions=len(grant.versions), expires_at=grant.expires_at.isoformat())
            assert self._grant is not None
            return self._grant.ticket

    async def keys_until_known(self, attempts: int = 3) -> None:
        """Read the keys at start, retrying briefly; a control plane that is down leaves them to the first use."""
        for attempt in range(attempts):
            try:
                await self.refresh_keys()
                return
            except TemporaryError as exc:
                event(log, "tickets.keys_unavailable", logging.WARNING, error=exc.message, attempt=attempt + 1)
                await asyncio.sleep(0.2 * 2**attempt)
