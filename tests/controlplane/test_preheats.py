"""Preheats and warm pools in the control plane: who gets what staged, progress, wake-ups, bad input."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from controlplane.fleet import desired_state
from controlplane.persistence.engine import query_count
from controlplane.persistence.rows import DeploymentRow
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from tests.controlplane.fleet_parts import (
    BackgroundPoll,
    Headers,
    desired,
    park,
    register,
    set_pointer,
    wait_until,
    waiting_polls,
)
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(90)


def staged(body: dict[str, Any]) -> list[str]:
    """The digests a desired state asks the node to stage."""
    return [s["digest"] for s in body.get("stage", [])]


def preheat(
    client: httpx.Client, headers: Headers, version: str, name: str = "chat", **selector: str
) -> httpx.Response:
    """``POST /v1/deployments/{name}/preheats``."""
    return client.post(
        f"/v1/deployments/{name}/preheats", json={"version": version, "selector": selector}, headers=headers
    )


def heartbeat(client: httpx.Client, headers: Headers, node_id: str, **held: str) -> None:
    """Report ``held`` (digest -> state) as the node's inventory."""
    inventory = [{"digest": d, "state": s, "bytes_total": 1000, "bytes_present": 1000} for d, s in held.items()]
    response = client.post(f"/v1/nodes/{node_id}/heartbeat", json={"inventory": inventory}, headers=headers)
    assert response.status_code == 204, response.text


def test_a_preheat_stages_the_version_on_every_matching_node_and_on_no_other(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    serving = register(cp_client, agent, "gpu-1", "chat", labels={"cluster": "c1"})
    spare = register(cp_client, agent, "spare-1", labels={"cluster": "c1"})  # registered for no deployment
    elsewhere = register(cp_client, agent, "gpu-2", "chat", labels={"cluster": "c2"})
    cache = register(cp_client, agent, "cache-1", labels={"cluster": "c1"}, role="cache")
    before = desired(cp_client, agent, serving)

    response = preheat(cp_client, operator, "v2", cluster="c1")

    assert response.status_code == 201, response.text
    assert response.json()["digest"] == chat["v2"]
    assert staged(desired(cp_client, agent, serving)) == [chat["v2"]]
    assert staged(desired(cp_client, agent, spare)) == [chat["v2"]]
    assert staged(desired(cp_client, agent, elsewhere)) == []
    assert staged(desired(cp_client, agent, cache)) == [], "caches warm by read-through, not by staging"
    after = desired(cp_client, agent, serving)
    assert after["deployments"] == before["deployments"], "a preheat switched what the node serves"
    assert after["revision"] != before["revision"]


def test_a_node_with_nothing_staged_keeps_the_revision_it_had_before_staging_existed(
    cp_client: httpx.Client, cp_state: AppState, agent: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    with cp_state.sessions() as session:
        row = session.get(DeploymentRow, "chat")
        assert row is not None
        expected = desired_state(node_id, "gpu-1", [row])
    body = desired(cp_client, agent, node_id)
    assert body["revision"] == expected.revision
    assert "stage" not in body, "agents that predate staging would refuse the unknown member"


def test_preheat_progress_counts_matched_staged_fetching_and_failed_nodes_from_heartbeats(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    nodes = [register(cp_client, agent, f"gpu-{i}", "chat", labels={"zone": "z1"}) for i in range(4)]
    register(cp_client, agent, "gpu-other", "chat", labels={"zone": "z2"})
    created = preheat(cp_client, operator, "v2", zone="z1").json()
    heartbeat(cp_client, agent, nodes[0], **{chat["v2"]: "ready"})
    heartbeat(cp_client, agent, nodes[1], **{chat["v2"]: "fetching"})
    heartbeat(cp_client, agent, nodes[2], **{chat["v2"]: "failed"})

    listed = cp_client.get("/v1/deployments/chat/preheats", headers=agent).json()

    assert [p["id"] for p in listed] == [created["id"]]
    progress = {k: listed[0][k] for k in ("nodes_matched", "nodes_staged", "nodes_fetching", "nodes_failed")}
    assert progress == {"nodes_matched": 4, "nodes_staged": 1, "nodes_fetching": 1, "nodes_failed": 1}


def test_asking_for_the_same_preheat_twice_returns_the_standing_one(
    cp_client: httpx.Client, operator: Headers, chat: dict[str, str]
) -> None:
    first = preheat(cp_client, operator, "v2", rack="r1")
    again = preheat(cp_client, operator, chat["v2"], rack="r1")  # the same version by digest
    other = preheat(cp_client, operator, "v2", rack="r2")
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 201)
    assert again.json()["id"] == first.json()["id"] != other.json()["id"]
    assert len(cp_client.get("/v1/deployments/chat/preheats", headers=operator).json()) == 2


def test_cancelling_a_preheat_unstages_it(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    created = preheat(cp_client, operator, "v3").json()
    assert staged(desired(cp_client, agent, node_id)) == [chat["v3"]]

    response = cp_client.delete(f"/v1/deployments/chat/preheats/{created['id']}", headers=operator)

    assert response.status_code == 204
    assert staged(desired(cp_client, agent, node_id)) == []
    again = cp_client.delete(f"/v1/deployments/chat/preheats/{created['id']}", headers=operator)
    assert again.status_code == 404
    assert problem(again)["code"] == "preheat_not_found"


def test_the_deployment_lists_its_preheated_versions_for_caches(
    cp_client: httpx.Client, operator: Headers, chat: dict[str, str]
) -> None:
    preheat(cp_client, operator, "v3")
    listed = cp_client.get("/v1/deployments", headers=operator).json()
    assert [d["preheated"] for d in listed] == [[chat["v3"]]]
    assert cp_client.get("/v1/deployments/chat", headers=operator).json()["preheated"] == [chat["v3"]]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"version": "v2", "selector": {"colour": "blue"}}, 400, "selector_invalid"),
        ({"version": "v2", "selector": {"Cluster": "c1"}}, 422, None),
        ({"version": "v9"}, 404, None),
        ({"version": ""}, 422, None),
        ({"version": "v2", "selector": {f"k{i}": "x" for i in range(17)}}, 422, None),
        ({"version": "sha256:" + "0" * 64}, 404, None),
    ],
)
def test_bad_preheats_are_refused_with_a_clear_error_and_change_nothing(
    cp_client: httpx.Client, operator: Headers, chat: dict[str, str], body: dict[str, Any], status: int,
    code: str | None,
) -> None:  # fmt: skip
    response = cp_client.post("/v1/deployments/chat/preheats", json=body, headers=operator)
    assert response.status_code == status, response.text
    if code is not None:
        assert problem(response)["code"] == code
        assert "cluster" in problem(response)["detail"], "the error names the labels a selector may use"
    assert cp_client.get("/v1/deployments/chat/preheats", headers=operator).json() == []


def test_a_version_of_another_model_or_not_ready_cannot_be_preheated(
    cp_client: httpx.Client, operator: Headers, chat: dict[str, str], seed_versions: Any
) -> None:
    other = seed_versions("mistral", ("m1",))
    pending = seed_versions("llama", ("v4",), state="pending")
    assert problem(preheat(cp_client, operator, other["m1"]))["code"] == "version_of_other_model"
    assert problem(preheat(cp_client, operator, pending["v4"]))["code"] == "version_not_ready"
    assert preheat(cp_client, operator, "v2", name="nope").status_code == 404


@pytest.mark.parametrize("role", [Role.publisher, Role.agent])
def test_only_operators_preheat_or_cancel(
    cp_client: httpx.Client, role_headers: dict[Role, Headers], operator: Headers, chat: dict[str, str], role: Role
) -> None:
    assert preheat(cp_client, role_headers[role], "v2").status_code == 403
    created = preheat(cp_client, operator, "v2").json()
    denied = cp_client.delete(f"/v1/deployments/chat/preheats/{created['id']}", headers=role_headers[role])
    assert denied.status_code == 403
    put = cp_client.put("/v1/deployments/chat/warm-pool", json={"selector": {}}, headers=role_headers[role])
    assert put.status_code == 403


def test_a_preheat_wakes_only_the_parked_polls_of_nodes_it_matches_at_a_cost_that_does_not_grow_with_them(
    quiet_recheck: None, live_controlplane: Any, cp_client: httpx.Client, agent: Headers, operator: Headers,
    chat: dict[str, str],
) -> None:  # fmt: skip
    state: AppState = live_controlplane.state
    url = live_controlplane.url
    costs = []
    for count, rack, version in ((2, "r1", "v2"), (12, "r2", "v3")):
        nodes = [register(cp_client, agent, f"{rack}-{i}", "chat", labels={"rack": rack}) for i in range(count)]
        matched = [park(url, agent, cp_client, node_id) for node_id in nodes]
        bystander_id = register(cp_client, agent, f"{rack}-x", "chat", labels={"rack": "x"})
        revision = desired(cp_client, agent, bystander_id)["revision"]
        bystander = BackgroundPoll(url, agent, bystander_id, revision, wait=4.0)
        wait_until(lambda n=count: waiting_polls(state) == n + 1, 10, "every long-poll parking")  # type: ignore[misc]
        before = query_count(state.engine)

        assert preheat(cp_client, operator, version, rack=rack).status_code == 201

        for poll in matched:
            assert staged(poll.join(timeout=10).json()) == [chat[version]]
        costs.append(query_count(state.engine) - before)
        # the bystander answers at its timeout, unchanged: the preheat did not move its state
        assert bystander.join(timeout=15).json()["revision"] == revision
    assert costs[0] == costs[1], f"queries per preheat grew with the parked polls it woke: {costs}"


def test_a_warm_pool_keeps_stable_and_canary_staged_on_matching_nodes_and_follows_the_pointer(
    live_controlplane: Any, cp_client: httpx.Client, agent: Headers, operator: Headers, seed_versions: Any
) -> None:
    digests = seed_versions("llama")
    body = {"name": "chat", "model": "llama", "warm_pool": {"selector": {"cluster": "warm"}}}
    created = cp_client.post("/v1/deployments", json=body, headers=operator)
    assert created.status_code == 201
    assert created.json()["warm_pool"] == {"selector": {"cluster": "warm"}}
    set_pointer(cp_client, operator, stable="v1")
    warm = register(cp_client, agent, "warm-1", labels={"cluster": "warm"})  # new capacity, no deployment yet
    cold = register(cp_client, agent, "cold-1", labels={"cluster": "cold"})
    assert staged(desired(cp_client, agent, warm)) == [digests["v1"]]
    assert staged(desired(cp_client, agent, cold)) == []

    poll = park(live_controlplane.url, agent, cp_client, warm)
    wait_until(lambda: waiting_polls(live_controlplane.state) == 1, 10, "the warm node's poll parking")
    set_pointer(cp_client, operator, stable="v1", canary="v2", canary_share=0.1)
    assert sorted(staged(poll.join(timeout=10).json())) == sorted([digests["v1"], digests["v2"]])

    dropped = cp_client.delete("/v1/deployments/chat/warm-pool", headers=operator)
    assert dropped.status_code == 200
    assert dropped.json()["warm_pool"] is None
    assert staged(desired(cp_client, agent, warm)) == []
    moved = cp_client.put("/v1/deployments/chat/warm-pool", json={"selector": {"cluster": "cold"}}, headers=operator)
    assert moved.status_code == 200
    assert staged(desired(cp_client, agent, cold)) == sorted([digests["v1"], digests["v2"]])


def test_a_warm_pool_with_an_unknown_label_is_refused_and_the_deployment_not_created(
    cp_client: httpx.Client, operator: Headers, seed_versions: Any
) -> None:
    seed_versions("llama")
    body = {"name": "chat", "model": "llama", "warm_pool": {"selector": {"pool": "warm"}}}
    response = cp_client.post("/v1/deployments", json=body, headers=operator)
    assert response.status_code == 400
    assert problem(response)["code"] == "selector_invalid"
    assert cp_client.get("/v1/deployments/chat", headers=operator).status_code == 404


def test_a_background_poll_of_an_unmatched_node_times_out_unchanged(
    live_controlplane: Any, cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat", labels={"zone": "z9"})
    revision = desired(cp_client, agent, node_id)["revision"]
    poll = BackgroundPoll(live_controlplane.url, agent, node_id, revision, wait=1.0)
    preheat(cp_client, operator, "v2", zone="z1")
    assert poll.join(timeout=10).json()["revision"] == revision
