"""Entitlement tickets (``weightship.tickets``): request one, read the signing keys."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from weightship.schemas.base import Digest, Name, Schema

__all__ = [
    "TicketGrant",
    "TicketKeys",
    "TicketRequest",
]

class TicketRequest(Schema):
    """A node asks for a ticket naming itself and these versions."""

    versions: list[Digest] = Field(min_length=1, max_length=256)
    audience: Name | None = Field(
        default=None,
        description="the node (peer, cache or tracker) the ticket will be sent to; only it accepts the ticket",
    )


class TicketKeys(Schema):
    """The public keys tickets are signed with: key id -> raw ed25519 public key, base64url."""

    keys: dict[str, str]


class TicketGrant(Schema):
    """A signed ticket, what it names, and the keys that verify tickets (so holders need no second call)."""

    ticket: str = Field(description="send as 'Authorization: Ticket <ticket>' to peers, caches and the tracker")
    node: Name
    versions: list[Digest]
    audience: str | None = None
    expires_at: datetime
    keys: dict[str, str] = Field(description="key id -> raw ed25519 public key, base64url")
