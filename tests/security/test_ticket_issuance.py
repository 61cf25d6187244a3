"""Ticket issuance: the control plane signs a ticket only for a node's own token and its entitlement.

Threat: a node (or anyone holding some token) obtains a ticket for weights it must not have: a
version of a deployment it does not serve, a version not ready, or a ticket naming another node;
or a token that is not a node's (admin, operator, publisher, enrolment) mints one. Runs against
the real control plane over HTTP on SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.controlplane.conftest import ADMIN_HEADERS, fake_digest, problem, seed_versions
from tests.security.ticket_parts import Headers, _ask
from weightship.schemas import Role, TicketGrant
from weightship.tickets import load_public_key, verify_ticket

pytestmark = pytest.mark.timeout(60)

__all__ = ["seed_versions"]  # the control-plane suite's fixture, used here


def _enrol(client: httpx.Client, name: str, *deployments: str, role: str = "node") -> Headers:
    body = {"name": name, "deployments": list(deployments), "role": role}
    response = client.post("/v1/nodes/enrol", json=body, headers=ADMIN_HEADERS)
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['token']}"}


def test_a_node_gets_a_ticket_naming_itself_for_the_versions_its_deployments_keep(
    cp_client: httpx.Client, fleet_state: dict[str, str]
) -> None:
    node = _enrol(cp_client, "gpu-1", "chat")
    wanted = [fleet_state["llama-v1"], fleet_state["llama-v2"], fleet_state["llama-v3"]]
    response = _ask(cp_client, node, *wanted)
    assert response.status_code == 200, response.text
    grant = TicketGrant.model_validate_json(response.content)
    keys = {kid: load_public_key(text) for kid, text in grant.keys.items()}
    ticket = verify_ticket(grant.ticket, keys, now=time.time())
    assert ticket.node == "gpu-1"
    assert ticket.versions == set(wanted)
    assert 590 <= ticket.exp - ticket.iat <= 600
    published = cp_client.get("/v1/tickets/keys", headers=node).json()["keys"]
    assert published == grant.keys  # the same key every time, and published


@pytest.mark.parametrize(
    "version",
    [
        pytest.param("llama-v4", id="a version no pointer names"),
        pytest.param("coder-v1", id="another deployment's version"),
        pytest.param("pending", id="a version not ready"),
        pytest.param("unknown", id="a version that does not exist"),
    ],
)
def test_a_node_is_refused_a_ticket_for_what_it_is_not_entitled_to(
    cp_client: httpx.Client, fleet_state: dict[str, str], version: str
) -> None:
    node = _enrol(cp_client, "gpu-1", "chat")
    digest = {"pending": fake_digest("llama", "pending"), "unknown": "sha256:" + "e" * 64}.get(version)
    digest = digest or fleet_state[version]
    response = _ask(cp_client, node, fleet_state["llama-v2"], digest)
    assert response.status_code == 403, response.text
    assert digest in problem(response)["detail"]  # names what was refused


def test_a_cache_is_entitled_to_every_version_any_pointer_names(
    cp_client: httpx.Client, fleet_state: dict[str, str]
) -> None:
    cache = _enrol(cp_client, "cache-1", role="cache")
    assert _ask(cp_client, cache, fleet_state["llama-v3"], fleet_state["coder-v1"]).status_code == 200
    assert _ask(cp_client, cache, fleet_state["llama-v4"]).status_code == 403


def test_tokens_that_are_not_a_nodes_own_get_no_ticket(
    cp_client: httpx.Client, fleet_state: dict[str, str], role_headers: dict[Role, Headers]
) -> None:
    version = fleet_state["llama-v2"]
    enrolment = cp_client.post("/v1/tokens", json={"name": "provisioning", "role": "agent"}, headers=ADMIN_HEADERS)
    holders = {**{role.value: role_headers[role] for role in Role}, "enrolment": {
        "Authorization": f"Bearer {enrolment.json()['token']}"
    }}  # fmt: skip
    for holder, headers in holders.items():
        response = _ask(cp_client, headers, version)
        assert response.status_code == 403, (holder, response.text)
    assert _ask(cp_client, {}, version).status_code == 401
    assert _ask(cp_client, {"Authorization": "Bearer ws_forged"}, version).status_code == 401


def test_a_ticket_request_that_is_malformed_is_refused_before_anything_is_signed(
    cp_client: httpx.Client, fleet_state: dict[str, str]
) -> None:
    node = _enrol(cp_client, "gpu-1", "chat")
    body: dict[str, Any]
    for body in ({"versions": []}, {"versions": ["v2"]}, {"versions": [fleet_state["llama-v2"]] * 257}, {}):
        assert cp_client.post("/v1/tickets", json=body, headers=node).status_code == 422, body
