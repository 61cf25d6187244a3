"""Entitlement tickets in isolation: signing, offline verification, and each way a ticket is refused."""

from __future__ import annotations

import base64
import json

import pytest

from weightship.errors import AuthError, ForbiddenError
from weightship.tickets import (
    CLOCK_SKEW_SECONDS,
    MAX_TICKET_CHARS,
    Ticket,
    TicketExpired,
    TicketInvalid,
    TicketMissing,
    TicketNotCovering,
    key_id,
    load_private_key,
    load_public_key,
    new_private_key,
    private_key_text,
    public_key_text,
    sign_ticket,
    ticket_from_header,
    verify_ticket,
)

pytestmark = pytest.mark.timeout(30)

V1 = "sha256:" + "1" * 64
V2 = "sha256:" + "2" * 64
NOW = 1_800_000_000


@pytest.fixture
def key() -> object:
    """A fresh signing key."""
    return new_private_key()


def _ticket(kid: str, **overrides: object) -> Ticket:
    fields: dict[str, object] = {"kid": kid, "node": "gpu-1", "versions": frozenset({V1}), "iat": NOW, "exp": NOW + 600}
    fields.update(overrides)
    return Ticket(**fields)  # type: ignore[arg-type]


def test_a_signed_ticket_verifies_offline_and_names_its_node_and_versions() -> None:
    private = new_private_key()
    kid = key_id(private.public_key())
    token = sign_ticket(private, _ticket(kid, versions=frozenset({V1, V2})))
    ticket = verify_ticket(token, {kid: private.public_key()}, now=NOW + 10)
    assert ticket.node == "gpu-1"
    assert ticket.versions == {V1, V2}
    assert ticket.exp == NOW + 600
    ticket.require(V1)
    payload = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert list(payload) == sorted(payload)
    assert payload["v"] == 1


def test_keys_round_trip_through_their_text_form() -> None:
    private = new_private_key()
    again = load_private_key(private_key_text(private))
    assert public_key_text(again.public_key()) == public_key_text(private.public_key())
    assert key_id(load_public_key(public_key_text(private.public_key()))) == key_id(private.public_key())


@pytest.mark.parametrize(
    ("now", "error"),
    [
        (NOW + 600 + CLOCK_SKEW_SECONDS - 1, None),  # within the allowed skew
        (NOW + 600 + CLOCK_SKEW_SECONDS + 1, TicketExpired),
        (NOW - CLOCK_SKEW_SECONDS + 1, None),
        (NOW - CLOCK_SKEW_SECONDS - 10, TicketInvalid),  # issued in the future
    ],
)
def test_expiry_allows_thirty_seconds_of_clock_skew_and_no_more(now: int, error: type[Exception] | None) -> None:
    private = new_private_key()
    kid = key_id(private.public_key())
    token = sign_ticket(private, _ticket(kid))
    if error is None:
        verify_ticket(token, {kid: private.public_key()}, now=now)
    else:
        with pytest.raises(error):
            verify_ticket(token, {kid: private.public_key()}, now=now)


def _tampered_payload(token: str) -> str:
    body, sig = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=="))
    payload["versions"].append(V2)
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode() + "." + sig


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(_tampered_payload, id="payload-widened"),
        pytest.param(
            lambda t: t.split(".")[0] + "." + base64.urlsafe_b64encode(b"x" * 64).decode(), id="bad-signature"
        ),
        pytest.param(lambda t: t.replace(".", ""), id="no-dot"),
        pytest.param(lambda t: "%%%." + t.split(".")[1], id="not-base64"),
        pytest.param(lambda t: base64.urlsafe_b64encode(b"[1,2]").decode() + "." + t.split(".")[1], id="not-object"),
        pytest.param(lambda t: "a" * (MAX_TICKET_CHARS + 1), id="too-long"),
    ],
)
def test_an_altered_or_malformed_ticket_is_invalid(mangle: object) -> None:
    private = new_private_key()
    kid = key_id(private.public_key())
    token = mangle(sign_ticket(private, _ticket(kid)))  # type: ignore[operator]
    with pytest.raises(TicketInvalid):
        verify_ticket(token, {kid: private.public_key()}, now=NOW)


def test_a_ticket_signed_by_an_unknown_key_is_invalid() -> None:
    forger = new_private_key()
    real = new_private_key()
    token = sign_ticket(forger, _ticket(key_id(real.public_key())))  # claims the real key's id
    with pytest.raises(TicketInvalid, match="does not verify"):
        verify_ticket(token, {key_id(real.public_key()): real.public_key()}, now=NOW)
    with pytest.raises(TicketInvalid, match="does not know"):
        verify_ticket(sign_ticket(forger, _ticket("other")), {key_id(real.public_key()): real.public_key()}, now=NOW)


def test_a_version_the_ticket_does_not_name_is_forbidden_not_unauthenticated() -> None:
    ticket = _ticket("k")
    assert not ticket.covers(V2)
    with pytest.raises(TicketNotCovering) as caught:
        ticket.require(V2)
    assert isinstance(caught.value, ForbiddenError)
    assert caught.value.status_code == 403


@pytest.mark.parametrize(
    ("header", "error"),
    [(None, TicketMissing), ("", TicketMissing), ("Bearer ws_x", TicketMissing), ("Ticket ", TicketMissing)],
)
def test_a_request_without_a_ticket_is_unauthenticated(header: str | None, error: type[Exception]) -> None:
    with pytest.raises(error) as caught:
        ticket_from_header(header)
    assert isinstance(caught.value, AuthError)
    assert caught.value.status_code == 401
    assert ticket_from_header("Ticket abc.def") == "abc.def"
    with pytest.raises(TicketMissing):
        verify_ticket(None, {}, now=NOW)
