"""The agent's ticket keeper against the real control plane: reuse, renewal at half-life, key checks."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest

import agent.tickets
from agent.controlplane_client import ControlPlaneClient
from agent.tickets import TicketKeeper
from tests.controlplane.conftest import (
    ADMIN_HEADERS,
    LiveControlPlane,
    SeedVersions,
    cp_client,
    cp_settings,
    cp_state,
    live_controlplane,
    seed_versions,
)
from weightship.errors import ForbiddenError
from weightship.testing import ManualClock
from weightship.tickets import (
    TicketExpired,
    TicketInvalid,
    TicketNotCovering,
    new_private_key,
    public_key_text,
    verify_ticket_signature,
)

pytestmark = pytest.mark.timeout(60)

__all__ = ["cp_client", "cp_settings", "cp_state", "live_controlplane", "seed_versions"]


@pytest.fixture
def node_token(cp_client: httpx.Client, seed_versions: SeedVersions) -> tuple[str, dict[str, str]]:
    """A node enrolled for deployment ``chat`` (stable v1, canary v2); its token and the digests."""
    digests = seed_versions("llama", ("v1", "v2", "v3"))
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN_HEADERS).is_success
    etag = cp_client.get("/v1/deployments/chat", headers=ADMIN_HEADERS).headers["etag"]
    body = {"stable": "v1", "canary": "v2", "canary_share": 0.1}
    moved = cp_client.put("/v1/deployments/chat/pointer", json=body, headers={**ADMIN_HEADERS, "If-Match": etag})
    assert moved.is_success, moved.text
    enrolled = cp_client.post("/v1/nodes/enrol", json={"name": "gpu-1", "deployments": ["chat"]}, headers=ADMIN_HEADERS)
    return enrolled.json()["token"], digests


async def test_a_ticket_is_reused_until_half_its_life_then_renewed(
    live_controlplane: LiveControlPlane, node_token: tuple[str, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    token, digests = node_token
    clock = ManualClock(time.time())
    client = ControlPlaneClient(live_controlplane.url, token)
    keeper = TicketKeeper(client, clock=clock)
    caplog.set_level(logging.INFO, logger="controlplane.tickets")

    def issued() -> int:
        return sum("ticket.issued" in r.getMessage() for r in caplog.records)

    try:
        first = await keeper.ticket_for([digests["v1"]])
        assert await keeper.ticket_for([digests["v1"]]) == first
        clock.now += 299  # default TTL 600 s: still in its first half
        assert await keeper.ticket_for([digests["v1"]]) == first
        assert issued() == 1
        clock.now += 2
        await keeper.ticket_for([digests["v1"]])
        assert issued() == 2  # renewed at half-life
        # Asking for more versions than held gets a ticket naming them at once.
        wider = await keeper.ticket_for([digests["v1"], digests["v2"]])
        checked = await keeper.check(f"Ticket {wider}", digests["v2"])
        assert checked.node == "gpu-1"
        with pytest.raises(ForbiddenError):
            await keeper.ticket_for([digests["v3"]])  # no pointer names v3
        with pytest.raises(TicketNotCovering):
            await keeper.check(f"Ticket {first}", digests["v2"])
        clock.now += 2000
        with pytest.raises(TicketExpired):
            await keeper.check(f"Ticket {first}", digests["v1"])
    finally:
        await client.aclose()


async def test_a_verified_ticket_is_remembered_but_its_dates_versions_and_keys_still_count(
    live_controlplane: LiveControlPlane, node_token: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    token, digests = node_token
    verified: list[str | None] = []

    def counting(token: str | None, keys: Any) -> Any:
        verified.append(token)
        return verify_ticket_signature(token, keys)

    monkeypatch.setattr(agent.tickets, "verify_ticket_signature", counting)
    monkeypatch.setattr(agent.tickets, "MAX_VERIFIED", 2)
    clock = ManualClock(time.time())
    client = ControlPlaneClient(live_controlplane.url, token)
    holder = TicketKeeper(client, clock=clock)
    checker = TicketKeeper(client, clock=clock, me="cache-1")
    try:
        ticket = await holder.ticket_for([digests["v1"]], audience="cache-1")
        await checker.refresh_keys()
        for _ in range(3):
            assert (await checker.check(f"Ticket {ticket}", digests["v1"])).node == "gpu-1"
        assert verified == [ticket]  # one Ed25519 verification for three requests
        with pytest.raises(TicketNotCovering):
            await checker.check(f"Ticket {ticket}", digests["v2"])
        body, _, signature = ticket.partition(".")
        forged = f"{body}.{signature[::-1]}"
        for _ in range(2):
            with pytest.raises(TicketInvalid):
                await checker.check(f"Ticket {forged}", digests["v1"])
        assert verified == [ticket, forged, forged]  # a token that failed is never remembered
        # Past MAX_VERIFIED the oldest token is forgotten: it verifies again at its next use.
        others = [await holder.ticket_for(wanted, audience="cache-1") for wanted in ([digests["v2"]], [digests["v1"], digests["v2"]])]
        await checker.check(f"Ticket {others[0]}", digests["v2"])
        await checker.check(f"Ticket {others[1]}", digests["v2"])
        await checker.check(f"Ticket {ticket}", digests["v1"])
        assert verified[-3:] == [others[0], others[1], ticket]
        clock.now += 2000
        with pytest.raises(TicketExpired):
            await checker.check(f"Ticket {ticket}", digests["v1"])
        clock.now -= 2000
        # New keys (the signing key retired): the remembered ticket is checked again, and refused.
        checker.learn_keys({"other": public_key_text(new_private_key().public_key())})
        with pytest.raises(TicketInvalid):
            await checker.check(f"Ticket {ticket}", digests["v1"])
    finally:
        await client.aclose()
