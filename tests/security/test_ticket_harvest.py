"""Harvested tickets and hostile announcements: a ticket opens only what one fetch needs, where it was sent.

Threat (a node holding its own credentials): it announces a proxy of its own to the tracker as a
peer holding a version, collects the tickets other nodes send it, and replays them at the cache
or at other peers to read what it was refused; or it announces an address that is not its own
(a cloud metadata service, another node) so the swarm sends requests and tickets there. The rules:
a node asks for a ticket naming only the version it fetches and the node it sends it to
(``aud``), and peers, caches and the tracker accept only tickets naming themselves; an announced
address is the one the node registered, never link-local or metadata. Real control plane, cluster
cache (tracker) and agent processes; the attacker's "peer" is a recording HTTP server.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from agent.chunkorder import bitmap_of, chunk_order
from tests.agent.agent_processes import AgentProcess, Spawn
from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from tests.agent.peers import chunk_request, peer_url
from weightship.manifest import Manifest
from weightship.schemas import NodeEnrolRequest
from weightship.testing import problem

pytestmark = pytest.mark.timeout(180)


class Harvester:
    """The attacker's fake peer: records every ``Authorization`` header sent to it, and serves nothing."""

    def __init__(self) -> None:
        self.headers: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._record)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _record(self, request: web.Request) -> web.Response:
        self.headers.append(request.headers.get("Authorization", ""))
        return web.Response(status=404, text="not here")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def harvester() -> AsyncIterator[Harvester]:
    found = Harvester()
    await found.start()
    yield found
    await found.stop()


def _node(fleet: Fleet, name: str, deployments: list[str], address: str | None = None) -> str:
    """Enrol ``name`` (as the admin) and return its node token."""
    with fleet.cp.client(ADMIN_TOKEN) as admin:
        return admin.enrol_node(NodeEnrolRequest(name=name, deployments=deployments, address=address)).token


def _ticket(fleet: Fleet, token: str, versions: list[str], audience: str) -> str:
    response = httpx.post(f"{fleet.cp.url}/v1/tickets", json={"versions": versions, "audience": audience},
                          headers={"Authorization": f"Bearer {token}"}, timeout=10)  # fmt: skip
    assert response.status_code == 200, response.text
    return str(response.json()["ticket"])


def _announce(tracker: str, ticket: str, node: str, address: str, manifest: Manifest) -> httpx.Response:
    count = len(chunk_order(manifest))
    have = base64.b64encode(bitmap_of(range(count), count)).decode()
    body = {"node": node, "address": address, "labels": {}, "upload_slots_free": 64,
            "versions": {manifest.digest: {"have": have}}}  # fmt: skip
    return httpx.post(f"{tracker}/v1/tracker/announce", json=body, headers={"Authorization": f"Ticket {ticket}"},
                      timeout=10)  # fmt: skip


def _payload(ticket: str) -> dict[str, object]:
    encoded = ticket.split(".", 1)[0]
    payload: dict[str, object] = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    return payload


async def test_a_harvested_ticket_opens_nothing_at_another_peer_or_cache(
    fleet: Fleet,
    cluster_cache: AgentProcess,
    harvester: Harvester,
    spawn: Spawn,
    model: str,
    make_model: Callable[..., Path],
) -> None:
    shared = fleet.publish(make_model("shared", tensors_mb=0.25, seed=41), f"{model[:60]}-a", "v1")
    secret = fleet.publish(make_model("secret", tensors_mb=0.25, seed=42), f"{model[:60]}-b", "v1")
    fleet.point(f"{model[:60]}-a", f"{model[:60]}-a", "v1")
    fleet.point(f"{model[:60]}-b", f"{model[:60]}-b", "v1")
    cache_url, cache_name = peer_url(cluster_cache), cluster_cache.name

    # The attacker: a node of deployment a only, which registered its harvesting proxy as its address.
    attacker = f"{model[:50]}-attacker"
    token = _node(fleet, attacker, [f"{model[:60]}-a"], address=harvester.url)
    announced = _announce(cache_url, _ticket(fleet, token, [shared.digest], cache_name), attacker, harvester.url,
                          shared)  # fmt: skip
    assert announced.status_code == 204, announced.text

    # The victim follows both deployments and fetches through the tracker: it asks the attacker first.
    victim = spawn(f"{model[:50]}-victim", deployments=[f"{model[:60]}-a", f"{model[:60]}-b"],
                   extra=["--peer-listen", "127.0.0.1:0", "--tracker", cache_url])  # fmt: skip
    await victim.ready()
    await victim.serving(shared.digest, name=f"{model[:60]}-a")
    await victim.serving(secret.digest, name=f"{model[:60]}-b")
    harvested = [h.removeprefix("Ticket ") for h in harvester.headers if h.startswith("Ticket ")]
    assert harvested, "the victim never sent the attacker's proxy a ticket"

    replays: list[int] = []
    async with httpx.AsyncClient(timeout=10) as http:
        for stolen in set(harvested):
            # what one fetch needs, bound to the attacker: not every version the victim holds
            payload = _payload(stolen)
            assert payload["versions"] == [shared.digest], payload
            assert payload["aud"] == attacker, payload
            for base, manifest in ((cache_url, secret), (cache_url, shared), (peer_url(victim), shared)):
                url, _chunk = chunk_request(base, manifest)
                answer = await http.get(url, headers={"Authorization": f"Ticket {stolen}"})
                assert answer.status_code == 403, f"{base} {manifest.digest}: {answer.status_code} {answer.text}"
                assert problem(answer)["code"] in ("ticket_wrong_audience", "ticket_not_covering")
                replays.append(answer.status_code)
        # The attacker's own ticket for the secret model is refused at the source: it is not entitled.
        refused = await http.post(f"{fleet.cp.url}/v1/tickets", headers={"Authorization": f"Bearer {token}"},
                                  json={"versions": [secret.digest], "audience": cache_name})  # fmt: skip
    assert refused.status_code == 403
    print(f"harvested {len(harvested)} tickets ({len(set(harvested))} distinct), each naming 1 version and the "
          f"attacker as audience; replays at the cache and another peer: {replays.count(403)}/{len(replays)} refused")


async def test_an_announcement_of_an_address_that_is_not_the_nodes_own_is_refused(
    fleet: Fleet,
    cluster_cache: AgentProcess,
    harvester: Harvester,
    model: str,
    make_model: Callable[..., Path],
) -> None:
    v1 = fleet.publish(make_model("addr", tensors_mb=0.1, seed=43), model[:60], "v1")
    fleet.point(model[:60], model[:60], "v1")
    cache_url, cache_name = peer_url(cluster_cache), cluster_cache.name

    # The control plane refuses to register a metadata address at all.
    metadata = "http://169.254.169.254:80"
    async with httpx.AsyncClient(timeout=10) as http:
        refused = await http.post(f"{fleet.cp.url}/v1/nodes/enrol", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                                  json={"name": f"{model[:50]}-meta", "deployments": [model[:60]],
                                        "address": metadata})  # fmt: skip
    assert refused.status_code == 400, refused.text
    assert "link-local" in problem(refused)["detail"]

    # A node registered at its own address may announce only that address.
    name = f"{model[:50]}-liar"
    ticket = _ticket(fleet, _node(fleet, name, [model[:60]], address=harvester.url), [v1.digest], cache_name)
    for address, status in ((metadata, 400), ("http://[fe80::1]:7071", 400), ("http://127.0.0.1:9", 403)):
        answer = _announce(cache_url, ticket, name, address, v1)
        assert answer.status_code == status, f"{address}: {answer.status_code} {answer.text}"
    assert _announce(cache_url, ticket, name, harvester.url, v1).status_code == 204
