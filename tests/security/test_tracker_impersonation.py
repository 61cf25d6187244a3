"""The tracker believes only what a node's ticket backs: no announcing for another node, no ticket no answer."""

from __future__ import annotations

import base64

import httpx
import pytest

from agent.tracker import Tracker
from tests.agent.tracker_parts import Signer, tracker_server
from weightship.manifest import Manifest
from weightship.testing import problem

pytestmark = pytest.mark.timeout(30)

V = "sha256:" + "ab" * 32
C = "cd" * 32


def _manifest() -> Manifest:
    from types import SimpleNamespace

    return SimpleNamespace(digest=V, files=(SimpleNamespace(chunks=(C,)),))  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("ticket_node", "body_node", "versions", "status"),
    [
        ("mallory", "alice", [V], 403),
        ("alice", "alice", [], 403),
        (None, "alice", [V], 401),
        ("alice", "alice", [V], 204),
    ],
    ids=["announce_for_another_node", "ticket_not_covering", "no_ticket", "own_announcement"],
)
async def test_announce_is_refused_unless_the_ticket_names_the_node_and_version(
    ticket_node: str | None, body_node: str, versions: list[str], status: int
) -> None:
    signer = Signer()
    tracker = Tracker()
    runner, url = await tracker_server(tracker, signer, {V: _manifest()})
    try:
        headers = {} if ticket_node is None else {"Authorization": f"Ticket {signer.sign(ticket_node, versions)}"}
        body = {"node": body_node, "address": "http://10.0.0.9:7071", "upload_slots_free": 4,
                "versions": {V: {"have": base64.b64encode(b"\x80").decode()}}}  # fmt: skip
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{url}/v1/tracker/announce", json=body, headers=headers)
        assert response.status_code == status, response.text
        if status != 204:
            assert problem(response)["status"] == status
        assert tracker.holders(V, 0) == ({"alice"} if status == 204 else set())
    finally:
        await runner.cleanup()
