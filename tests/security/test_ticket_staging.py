"""Tickets for staged versions: a preheat or warm pool entitles exactly the nodes it matches.

Threat: staging widens who may fetch weights. A node must get a ticket for a version it has to
stage (so staging can use peers and caches), but not for a version staged on *other* nodes, nor
for a warm pool's versions when it is outside the pool, nor once the preheat is cancelled.
Runs against the real control plane over HTTP on SQLite and PostgreSQL.
"""

from __future__ import annotations

import httpx
import pytest

from tests.controlplane.conftest import ADMIN_HEADERS, problem, seed_versions
from tests.security.ticket_parts import Headers, _ask

pytestmark = pytest.mark.timeout(60)

__all__ = ["seed_versions"]  # the control-plane suite's fixture, used here


def _enrol(client: httpx.Client, name: str, *deployments: str, labels: dict[str, str]) -> Headers:
    body = {"name": name, "deployments": list(deployments), "labels": labels}
    response = client.post("/v1/nodes/enrol", json=body, headers=ADMIN_HEADERS)
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['token']}"}


def test_a_preheat_entitles_the_nodes_it_matches_and_no_other_until_it_is_cancelled(
    cp_client: httpx.Client, fleet_state: dict[str, str]
) -> None:
    matched = _enrol(cp_client, "gpu-1", "chat", labels={"rack": "r1"})
    spare = _enrol(cp_client, "spare-1", labels={"rack": "r1"})
    other = _enrol(cp_client, "gpu-2", "chat", labels={"rack": "r2"})
    v4 = fleet_state["llama-v4"]  # no pointer names it
    made = cp_client.post(
        "/v1/deployments/chat/preheats", json={"version": "v4", "selector": {"rack": "r1"}}, headers=ADMIN_HEADERS
    )
    assert made.status_code == 201, made.text

    assert _ask(cp_client, matched, v4).status_code == 200
    assert _ask(cp_client, spare, v4).status_code == 200
    refused = _ask(cp_client, other, v4)
    assert refused.status_code == 403
    assert v4 in problem(refused)["detail"]

    cancelled = cp_client.delete(f"/v1/deployments/chat/preheats/{made.json()['id']}", headers=ADMIN_HEADERS)
    assert cancelled.status_code == 204
    assert _ask(cp_client, matched, v4).status_code == 403


def test_a_warm_pool_entitles_its_nodes_to_stable_and_canary_only(
    cp_client: httpx.Client, fleet_state: dict[str, str]
) -> None:
    pool = cp_client.put(
        "/v1/deployments/chat/warm-pool", json={"selector": {"cluster": "warm"}}, headers=ADMIN_HEADERS
    )
    assert pool.status_code == 200, pool.text
    warm = _enrol(cp_client, "warm-1", labels={"cluster": "warm"})
    cold = _enrol(cp_client, "cold-1", labels={"cluster": "cold"})
    stable, canary, previous = fleet_state["llama-v2"], fleet_state["llama-v3"], fleet_state["llama-v1"]

    assert _ask(cp_client, warm, stable, canary).status_code == 200
    assert _ask(cp_client, warm, previous).status_code == 403, "a warm pool stages stable and canary only"
    assert _ask(cp_client, cold, stable).status_code == 403
