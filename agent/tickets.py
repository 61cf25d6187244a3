"""The agent's side of entitlement: the control plane's public keys, and this node's own ticket.

Two jobs, both offline on the hot path:

- **Checking** tickets that requesters present to this agent's peer listener: with the public
  keys learnt from the control plane (``GET /v1/tickets/keys``, and every grant). A ticket signed
  by a key this agent does not know yet triggers one re-read of the keys, at most every
  ``KEY_REFRESH_SECONDS``, so a rotation is picked up without letting forged key ids make it call
  the control plane per request. A token whose signature verified is remembered (at most
  ``MAX_VERIFIED``, until the keys change), so the next request with it costs a lookup instead of
  an Ed25519 verification; its dates, audience and versions are checked at every request. A node
  sends the same ticket per (version, audience) until renewal, so a cache or tracker answering
  every node's requests verifies each ticket once. Only tokens that verified are remembered: forged
  ones cost a verification each time and evict nothing but older tokens.
- **Holding** this node's own tickets for what it fetches from peers and caches.
  ``ticket_for(versions, audience)`` returns a ticket naming exactly ``versions`` (a fetch asks
  for the one version it fetches) and ``audience``, the node the ticket is sent to (a peer, a
  cache, the tracker), so a ticket harvested by the node it was sent to opens nothing elsewhere.
  A held ticket is reused until half its life (renewal at half-life, so a ticket never expires in
  flight); if renewal fails while the held one is in date, the held one is used and renewal
  retried next time. Tickets are held per (versions, audience), at most ``MAX_HELD``.

**Audience.** An agent that knows its own name (``me``) refuses a ticket whose ``aud`` names
another node (``TicketWrongAudience``, 403). A ticket without ``aud`` is a plain bearer ticket of
its node (one asked for without an audience, by a tool); agents always ask with one. Which name a
cache or tracker URL has is read from its peer listener (``GET /v1/identity``) by ``Audiences``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from weightship.backoff import Backoff
from weightship.errors import TemporaryError, WeightshipError
from weightship.logs import event
from weightship.schemas import TicketGrant, TicketKeys
from weightship.tickets import Ticket, TicketInvalid, load_public_key, ticket_from_header, verify_ticket_signature

__all__ = ["KEY_REFRESH_SECONDS", "MAX_HELD", "MAX_VERIFIED", "Audiences", "TicketKeeper", "TicketSource"]

log = logging.getLogger("agent.tickets")

#: least time between two re-reads of the keys caused by an unknown key id
KEY_REFRESH_SECONDS = 30.0
#: most tickets held at once (one per versions and audience); all are dropped past it
MAX_HELD = 1024
#: most verified tokens remembered at once (the oldest is forgotten past it)
MAX_VERIFIED = 4096
#: after a peer listener did not say its name, ask it again after this long
IDENTITY_RETRY_SECONDS = 5.0


class TicketSource(Protocol):
    """Where tickets and keys come from: the control plane (``ControlPlaneClient``)."""

    async def ticket(self, versions: list[str]) -> TicketGrant:
        """A ticket naming this node and ``versions`` (sources that take ``audience=`` get it by keyword)."""

    async def ticket_keys(self) -> TicketKeys:
        """The public keys tickets are signed with."""


class TicketKeeper:
    """Public keys for checking tickets, and this node's own ticket (renewed at half-life)."""

    def __init__(self, source: TicketSource, clock: Callable[[], float] = time.time, me: str | None = None) -> None:
        self.source = source
        self.clock = clock
        #: this agent's node name: tickets naming another audience are refused here
        self.me = me
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._key_texts: dict[str, str] = {}
        #: tokens whose signature verified under ``_keys``, oldest first
        self._verified: dict[str, Ticket] = {}
        self._keys_read = float("-inf")
        self._held: dict[tuple[frozenset[str], str | None], tuple[TicketGrant, float]] = {}
        self._locks: dict[tuple[frozenset[str], str | None], asyncio.Lock] = {}

    # --- checking others' tickets --------------------------------------------------------------

    def learn_keys(self, keys: dict[str, str]) -> None:
        """Add the keys of a ``TicketKeys`` or ``TicketGrant`` answer (and forget retired ones)."""
        if keys == self._key_texts:
            self._keys_read = time.monotonic()
            return
        self._keys = {kid: load_public_key(text) for kid, text in keys.items()}
        self._key_texts = dict(keys)
        self._verified.clear()  # a retired key's tickets must verify again (and fail)
        self._keys_read = time.monotonic()

    async def refresh_keys(self) -> None:
        """Re-read the keys from the control plane."""
        self.learn_keys((await self.source.ticket_keys()).keys)
        event(log, "tickets.keys_read", keys=",".join(sorted(self._keys)))

    async def check(self, header: str | None, version: str) -> Ticket:
        """The ticket in ``header`` if it is genuine, in date and covers ``version``; else a ``Ticket*`` error."""
        token = ticket_from_header(header)
        ticket = self._verified.get(token) if token else None
        if ticket is None:
            ticket = await self._verify(token)
        ticket.require_in_date(self.clock())
        if self.me is not None and ticket.aud is not None:
            ticket.require_audience(self.me)
        ticket.require(version)
        return ticket

    async def _verify(self, token: str | None) -> Ticket:
        try:
            ticket = verify_ticket_signature(token, self._keys)
        except TicketInvalid:
            if not await self._maybe_refresh():
                raise
            ticket = verify_ticket_signature(token, self._keys)
        assert token is not None  # verify_ticket_signature refuses a missing one
        if len(self._verified) >= MAX_VERIFIED:
            del self._verified[next(iter(self._verified))]
        self._verified[token] = ticket
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

    def _fresh(self, held: tuple[TicketGrant, float] | None) -> bool:
        if held is None:
            return False
        grant, issued_at = held
        lifetime = grant.expires_at.timestamp() - issued_at
        return self.clock() < issued_at + lifetime / 2

    async def ticket_for(self, versions: Iterable[str], audience: str | None = None) -> str:
        """A ticket naming exactly ``versions`` and ``audience``, held or freshly issued (``ForbiddenError`` if not entitled)."""
        wanted = frozenset(versions)
        key = (wanted, audience)
        if len(self._locks) >= MAX_HELD and key not in self._locks:
            self._locks = {k: lock for k, lock in self._locks.items() if lock.locked()}
            self._held.clear()
        async with self._locks.setdefault(key, asyncio.Lock()):
            held = self._held.get(key)
            if self._fresh(held):
                assert held is not None
                return held[0].ticket
            try:
                grant = await self._ask(sorted(wanted), audience)
            except WeightshipError as exc:
                if held is not None and held[0].expires_at.timestamp() > self.clock():
                    # Renewal failed but the held ticket is still valid: use it, retry next time.
                    event(log, "tickets.renewal_failed", logging.WARNING, error=exc.message)
                    return held[0].ticket
                raise
            self._held[key] = (grant, self.clock())
            self.learn_keys(grant.keys)
            event(log, "tickets.issued", versions=len(grant.versions), audience=audience,
                  expires_at=grant.expires_at.isoformat())  # fmt: skip
            return grant.ticket

    async def _ask(self, versions: list[str], audience: str | None) -> TicketGrant:
        if audience is None:
            return await self.source.ticket(versions)
        ask: Callable[..., Awaitable[TicketGrant]] = self.source.ticket
        return await ask(versions, audience=audience)

    async def keys_until_known(self, attempts: int = 3) -> None:
        """Read the keys at start, retrying briefly; a control plane that is down leaves them to the first use."""

        def unavailable(attempt: int, _delay: float, error: WeightshipError) -> None:
            event(log, "tickets.keys_unavailable", logging.WARNING, error=error.message, attempt=attempt)

        try:
            await Backoff(attempts, base=0.2, cap=0.8).run_async(self.refresh_keys, on_retry=unavailable)
        except TemporaryError as exc:
            unavailable(attempts, 0.0, exc)


class Audiences:
    """The node name behind each peer-listener URL (a cache, the tracker), read once from ``GET /v1/identity``.

    A ticket is asked for the name found here; a listener that does not answer is asked again after
    ``IDENTITY_RETRY_SECONDS`` and meanwhile gets a ticket without an audience.
    """

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._failed: dict[str, float] = {}
        self._session: aiohttp.ClientSession | None = None

    async def name_of(self, base: str) -> str | None:
        """The node name of the peer listener at ``base``; None when it cannot be read now."""
        base = base.rstrip("/")
        name = self._names.get(base)
        if name is not None or time.monotonic() < self._failed.get(base, float("-inf")):
            return name
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            async with self._session.get(f"{base}/v1/identity") as response:
                found = (await response.json()).get("node") if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            found, error = None, repr(exc)
        else:
            error = "" if isinstance(found, str) and found else "no node name in the answer"
        if error:
            self._failed[base] = time.monotonic() + IDENTITY_RETRY_SECONDS
            event(log, "tickets.audience_unknown", logging.WARNING, url=base, error=error,
                  retry_in=IDENTITY_RETRY_SECONDS)  # fmt: skip
            return None
        assert isinstance(found, str)
        self._names[base] = found
        return found

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
