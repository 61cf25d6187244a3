"""Tickets at the peer listener: weights go only to holders of a genuine, current, covering ticket.

Threat: anyone who can reach a node's or cache's peer port (another tenant's pod, a compromised
host on the cluster network) downloads confidential weights: with no ticket, a forged or altered
one, an API bearer token, an expired ticket, or a genuine ticket for another version. A ticket
is a bearer capability bound to a node name: the peer cannot tell who connects (no mTLS), so what
bounds a stolen ticket is its short life and its version list (the tracker additionally refuses
an announce whose node differs from the ticket's). Real control plane and agent processes; the
expired ticket is signed with the control plane's real key, read from its database.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.agent.agent_processes import AgentProcess, Spawn
from tests.agent.fleet import Fleet
from tests.agent.peers import chunk_request, largest_file, peer_url, ticket
from weightship.manifest import Manifest
from weightship.testing import problem
from weightship.tickets import CLOCK_SKEW_SECONDS, Ticket, load_private_key, new_private_key, sign_ticket

pytestmark = pytest.mark.timeout(120)


async def _serving_peer(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> tuple[AgentProcess, Manifest, Manifest]:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.25, seed=11), model, "v1")
    v2 = fleet.publish(make_model("m2", tensors_mb=0.25, seed=12), model, "v2")
    fleet.point(deployment, model, "v1")
    node = spawn(f"{model[:60]}-node", extra=["--peer-listen", "127.0.0.1:0"])
    await node.ready()
    await node.serving(v1.digest)
    return node, v1, v2


def _signing_key(fleet: Fleet) -> tuple[str, str]:
    with sqlite3.connect(fleet.cp.database) as db:
        kid, private = db.execute("SELECT kid, private_key FROM ticket_keys WHERE NOT retired").fetchone()
    return str(kid), str(private)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def test_a_peer_refuses_requests_without_a_genuine_current_covering_ticket(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    node, v1, _v2 = await _serving_peer(fleet, spawn, model, deployment, make_model)
    genuine = ticket(fleet, f"{model}-holder", [deployment], [v1.digest])
    url, _ = chunk_request(peer_url(node), v1, largest_file(v1))
    kid, private = _signing_key(fleet)
    now = int(time.time())
    expired = sign_ticket(
        load_private_key(private),
        Ticket(kid=kid, node=f"{model}-holder", versions=frozenset({v1.digest}), iat=now - 1200, exp=now - 600),
    )
    body, signature = genuine.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=="))
    payload["exp"] += 86400
    widened = _b64(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()) + "." + signature
    forged = sign_ticket(
        new_private_key(),
        Ticket(kid=kid, node=f"{model}-holder", versions=frozenset({v1.digest}), iat=now, exp=now + 600),
    )
    cases: list[tuple[str, dict[str, str], int]] = [
        ("no ticket", {}, 401),
        ("API bearer token", {"Authorization": f"Bearer {fleet.agent_token}"}, 401),
        ("garbage", {"Authorization": "Ticket not-a-ticket"}, 401),
        ("forged with another key", {"Authorization": f"Ticket {forged}"}, 401),
        ("altered expiry", {"Authorization": f"Ticket {widened}"}, 401),
        (f"expired over {CLOCK_SKEW_SECONDS}s ago", {"Authorization": f"Ticket {expired}"}, 403),
    ]
    async with httpx.AsyncClient(timeout=10) as http:
        for what, headers, status in cases:
            response = await http.get(url, headers=headers)
            assert response.status_code == status, (what, response.text)
            assert problem(response)["status"] == status, what  # an error, no weights
        assert (await http.get(url, headers={"Authorization": f"Ticket {genuine}"})).status_code == 200


async def test_a_ticket_for_one_version_does_not_open_another(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    node, v1, v2 = await _serving_peer(fleet, spawn, model, deployment, make_model)
    fleet.point(deployment, model, "v2")
    await node.serving(v2.digest)  # the node holds both now
    only_v1 = ticket(fleet, f"{model}-holder", [deployment], [v1.digest])
    url, _ = chunk_request(peer_url(node), v2, largest_file(v2))
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(url, headers={"Authorization": f"Ticket {only_v1}"})
        assert response.status_code == 403, response.text
        assert problem(response)["code"] == "ticket_not_covering"
        # v1 is no longer named by stable, but as previous stable it still is: a ticket for it is issued.
        both = ticket(fleet, f"{model}-holder2", [deployment], [v1.digest, v2.digest])
        assert (await http.get(url, headers={"Authorization": f"Ticket {both}"})).status_code == 200
