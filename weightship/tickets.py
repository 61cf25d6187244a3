"""Entitlement tickets: short-lived, ed25519-signed capabilities to fetch chunks of named versions.

A ticket is ``base64url(payload) + "." + base64url(signature)`` (no padding), where ``payload``
is canonical JSON (sorted keys, no whitespace, UTF-8)::

    {"v": 1, "kid": "<key id>", "node": "<node name>", "versions": ["sha256:…", …],
     "aud": "<node name>", "addr": "<registered peer address>", "iat": <issued at, unix s>,
     "exp": <expires at, unix s>}

and ``signature`` is the ed25519 signature of exactly those payload bytes by the control plane's
key ``kid``. Peers, caches and the tracker check a ticket *offline*: with the public keys they got
at registration (or from ``GET /v1/tickets/keys``), no control-plane call per chunk.

What a ticket is, and is not: a **bearer capability bound to a node name and an audience**. It
names the node it was issued to, but a peer cannot tell who connects (no mTLS), so whoever holds
the string can use it until ``exp``. So a ticket names its ``aud``: the one node (peer, cache or
tracker) it is sent to, which accepts it only when ``aud`` is its own name
(``Ticket.require_audience``); a ticket is asked for what one fetch needs (the version being
fetched); tickets are short-lived (10 minutes by default); and the tracker refuses an announce
whose ``node`` differs from the ticket's node. A ticket harvested by the peer it was sent to opens
nothing at any other peer or cache, and never lets its holder pose as another node in the swarm.
``aud`` is left out of the payload when a ticket has none (a plain bearer ticket, asked for
without an audience; agents always ask with one). ``addr`` is the peer address the node
registered, when it has one: the tracker accepts an announcement only for that address, so a node
cannot point the swarm (and its tickets) anywhere else.

Errors map onto HTTP like this: no ticket (``TicketMissing``) or one that does not parse or
verify (``TicketInvalid``) is 401; a valid ticket that expired (``TicketExpired``) or does not
name the version asked for (``TicketNotCovering``) is 403. Clocks may disagree by up to
``CLOCK_SKEW_SECONDS``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from weightship.errors import AuthError, ForbiddenError, ValidationError
from weightship.manifest import canonical_json

__all__ = [
    "AUTH_SCHEME",
    "CLOCK_SKEW_SECONDS",
    "MAX_TICKET_CHARS",
    "MAX_VERSIONS",
    "Ticket",
    "TicketExpired",
    "TicketInvalid",
    "TicketMissing",
    "TicketNotCovering",
    "TicketWrongAudience",
    "key_id",
    "load_private_key",
    "load_public_key",
    "new_private_key",
    "private_key_text",
    "public_key_text",
    "sign_ticket",
    "ticket_from_header",
    "verify_ticket",
    "verify_ticket_signature",
]

#: the ``Authorization`` scheme: ``Authorization: Ticket <token>``
AUTH_SCHEME = "Ticket"
#: how far clocks may disagree: a ticket is accepted this long past ``exp`` (and before ``iat``)
CLOCK_SKEW_SECONDS = 30
#: longest token parsed at all, so a hostile header costs no more than this to reject
MAX_TICKET_CHARS = 64 * 1024
#: most versions one ticket may name
MAX_VERSIONS = 256
_VERSION = 1


class TicketMissing(AuthError):
    """No ticket was presented (401)."""

    code = "ticket_missing"


class TicketInvalid(AuthError):
    """A ticket that does not parse, or whose signature does not verify with a known key (401)."""

    code = "ticket_invalid"


class TicketExpired(ForbiddenError):
    """A genuine ticket past its expiry (403): the holder renews it at the control plane."""

    code = "ticket_expired"


class TicketNotCovering(ForbiddenError):
    """A genuine ticket that does not name the version asked for (403)."""

    code = "ticket_not_covering"


class TicketWrongAudience(ForbiddenError):
    """A genuine ticket issued for another audience (403): a ticket is good only where it was sent."""

    code = "ticket_wrong_audience"


@dataclass(frozen=True, slots=True)
class Ticket:
    """The payload of a ticket: who it was issued to, for which versions, and when it lapses."""

    kid: str
    node: str
    versions: frozenset[str]
    iat: int
    exp: int
    #: the node the ticket is sent to (a peer, cache or tracker): the only one that accepts it
    aud: str | None = None
    #: the peer address the node registered (what it may announce to the tracker)
    addr: str | None = None

    def payload(self) -> dict[str, Any]:
        """The JSON object that is signed (versions sorted, so equal tickets sign equal bytes)."""
        body: dict[str, Any] = {
            "v": _VERSION,
            "kid": self.kid,
            "node": self.node,
            "versions": sorted(self.versions),
            "iat": self.iat,
            "exp": self.exp,
        }
        if self.aud is not None:
            body["aud"] = self.aud
        if self.addr is not None:
            body["addr"] = self.addr
        return body

    def require_audience(self, me: str) -> None:
        """Raise ``TicketWrongAudience`` unless the ticket was issued to be sent to the node ``me``."""
        if self.aud != me:
            raise TicketWrongAudience(
                f"ticket of node {self.node!r} is for audience {self.aud!r}, not this node ({me!r}); a ticket is "
                f"good only at the node it was issued for: the requester asks the control plane for one naming "
                f"{me!r} (POST /v1/tickets with audience)"
            )

    def require_in_date(self, now: float) -> None:
        """Raise ``TicketExpired`` past ``exp``, ``TicketInvalid`` before ``iat`` (both with ``CLOCK_SKEW_SECONDS``)."""
        if now > self.exp + CLOCK_SKEW_SECONDS:
            raise TicketExpired(
                f"ticket of node {self.node!r} expired {int(now - self.exp)} s ago; the node renews it (POST /v1/tickets)"
            )
        if now + CLOCK_SKEW_SECONDS < self.iat:
            raise TicketInvalid(f"ticket of node {self.node!r} is issued in the future: check the clocks")

    def covers(self, version: str) -> bool:
        """Whether the ticket names ``version``."""
        return version in self.versions

    def require(self, version: str) -> None:
        """Raise ``TicketNotCovering`` unless the ticket names ``version``."""
        if version not in self.versions:
            raise TicketNotCovering(
                f"ticket of node {self.node!r} does not cover version {version!r}; "
                "the node asks the control plane for a ticket naming it (POST /v1/tickets)"
            )


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# --- keys ----------------------------------------------------------------------------------------


def new_private_key() -> Ed25519PrivateKey:
    """A fresh ed25519 signing key."""
    return Ed25519PrivateKey.generate()


def public_key_text(key: Ed25519PublicKey) -> str:
    """The raw 32-byte public key, base64url: how keys travel in API responses."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return _b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def private_key_text(key: Ed25519PrivateKey) -> str:
    """The raw 32-byte private seed, base64url: how the control plane stores its key."""
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    return _b64encode(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))


def load_public_key(text: str) -> Ed25519PublicKey:
    """The public key written by ``public_key_text``; ``ValidationError`` for anything else."""
    try:
        return Ed25519PublicKey.from_public_bytes(_b64decode(text))
    except (ValueError, binascii.Error) as exc:
        raise ValidationError(f"not an ed25519 public key (32 bytes, base64url): {text[:80]!r}") from exc


def load_private_key(text: str) -> Ed25519PrivateKey:
    """The private key written by ``private_key_text``; ``ValidationError`` for anything else."""
    try:
        return Ed25519PrivateKey.from_private_bytes(_b64decode(text))
    except (ValueError, binascii.Error) as exc:
        raise ValidationError("stored ticket signing key is not a 32-byte ed25519 seed (base64url)") from exc


def key_id(key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the first 16 hex of the SHA-256 of its raw bytes."""
    return hashlib.sha256(_b64decode(public_key_text(key))).hexdigest()[:16]


# --- signing and verifying ----------------------------------------------------------------------


def sign_ticket(private_key: Ed25519PrivateKey, payload: Ticket) -> str:
    """The token for ``payload``, signed with ``private_key`` (whose ``key_id`` should be ``payload.kid``)."""
    if len(payload.versions) > MAX_VERSIONS:
        raise ValidationError(f"a ticket names at most {MAX_VERSIONS} versions; asked for {len(payload.versions)}")
    body = canonical_json(payload.payload())
    return _b64encode(body) + "." + _b64encode(private_key.sign(body))


def ticket_from_header(header: str | None) -> str:
    """The token in an ``Authorization: Ticket <token>`` header; ``TicketMissing`` / ``TicketInvalid``."""
    if not header or not header.strip():
        raise TicketMissing("no ticket: send 'Authorization: Ticket <token>' (the node gets one with POST /v1/tickets)")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != AUTH_SCHEME.lower() or not token.strip():
        raise TicketMissing("Authorization header must be 'Ticket <token>'; bearer API tokens are not accepted here")
    return token.strip()


def _string_list(value: Any) -> Iterable[str]:
    if not isinstance(value, list) or len(value) > MAX_VERSIONS or not all(isinstance(v, str) for v in value):
        raise TicketInvalid(f"ticket payload 'versions' must be a list of at most {MAX_VERSIONS} strings")
    return value


def _parse_payload(body: bytes) -> Ticket:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise TicketInvalid("ticket payload is not JSON") from exc
    if not isinstance(obj, dict) or obj.get("v") != _VERSION:
        raise TicketInvalid(f"ticket payload is not a version-{_VERSION} ticket")
    kid, node, iat, exp, aud = obj.get("kid"), obj.get("node"), obj.get("iat"), obj.get("exp"), obj.get("aud")
    if not (isinstance(kid, str) and isinstance(node, str) and node):
        raise TicketInvalid("ticket payload lacks 'kid' or 'node'")
    if aud is not None and not (isinstance(aud, str) and aud):
        raise TicketInvalid("ticket payload 'aud' must be a node name")
    addr = obj.get("addr")
    if addr is not None and not isinstance(addr, str):
        raise TicketInvalid("ticket payload 'addr' must be a URL")
    if not (isinstance(iat, int) and isinstance(exp, int)) or isinstance(iat, bool) or isinstance(exp, bool):
        raise TicketInvalid("ticket payload 'iat' and 'exp' must be integers (unix seconds)")
    return Ticket(kid=kid, node=node, versions=frozenset(_string_list(obj.get("versions"))), iat=iat, exp=exp, aud=aud,
                  addr=addr)


def verify_ticket(token: str | None, public_keys: Mapping[str, Ed25519PublicKey], now: float) -> Ticket:
    """The ticket ``token`` carries, once its signature verifies with ``public_keys[kid]`` and it is in date.

    Raises ``TicketMissing`` (no token), ``TicketInvalid`` (malformed, unknown key, bad signature:
    401) or ``TicketExpired`` (403). Whether it covers a version is the caller's check
    (``Ticket.require``).
    """
    ticket = verify_ticket_signature(token, public_keys)
    ticket.require_in_date(now)
    return ticket


def verify_ticket_signature(token: str | None, public_keys: Mapping[str, Ed25519PublicKey]) -> Ticket:
    """The ticket ``token`` carries, once its signature verifies with ``public_keys[kid]``; not its dates.

    The same token always gives the same answer under the same keys, so a checker may remember the
    tokens that passed (``agent.tickets``), as long as it forgets them when its keys change and
    still calls ``Ticket.require_in_date`` at every use.
    """
    if not token:
        raise TicketMissing("no ticket: send 'Authorization: Ticket <token>' (the node gets one with POST /v1/tickets)")
    if len(token) > MAX_TICKET_CHARS:
        raise TicketInvalid(f"ticket is longer than {MAX_TICKET_CHARS} characters")
    encoded_body, dot, encoded_sig = token.partition(".")
    if not dot or not encoded_body or not encoded_sig:
        raise TicketInvalid("ticket must be '<base64url payload>.<base64url signature>'")
    try:
        body, signature = _b64decode(encoded_body), _b64decode(encoded_sig)
    except (ValueError, binascii.Error) as exc:
        raise TicketInvalid("ticket is not base64url") from exc
    ticket = _parse_payload(body)
    key = public_keys.get(ticket.kid)
    if key is None:
        raise TicketInvalid(
            f"ticket is signed with key {ticket.kid!r}, which this agent does not know; "
            "it re-reads the control plane's keys (GET /v1/tickets/keys) or the ticket is forged"
        )
    try:
        key.verify(signature, body)
    except InvalidSignature as exc:
        raise TicketInvalid("ticket signature does not verify: the ticket was altered or forged") from exc
    return ticket
