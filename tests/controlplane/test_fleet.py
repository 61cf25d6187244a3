"""The fleet: registration, heartbeats, stale nodes, desired state and its canary subset, status."""

from __future__ import annotations

import dataclasses
import math
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from controlplane.fleet import RECHECK_SECONDS, canary_bucket, in_canary
from controlplane.http import fleet as fleet_routes
from controlplane.persistence.rows import DeploymentRow, NodeRow, utcnow
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from tests.controlplane.fleet_parts import (
    BackgroundPoll,
    Headers,
    desired,
    register,
    set_pointer,
    wait_until,
    waiting_polls,
)

pytestmark = pytest.mark.timeout(60)


# --- registration and heartbeats ----------------------------------------------------------------


def test_reregistering_a_name_keeps_its_id_and_replaces_its_labels(cp_client: httpx.Client, agent: Headers) -> None:
    first = register(cp_client, agent, "gpu-1", "chat", labels={"zone": "a"})
    again = register(cp_client, agent, "gpu-1", "chat", "embed", labels={"zone": "b", "gpu_type": "h100"})
    other = register(cp_client, agent, "gpu-2")
    assert first == again != other
    (node,) = [n for n in cp_client.get("/v1/nodes", headers=agent).json() if n["name"] == "gpu-1"]
    assert (node["labels"]["zone"], node["labels"]["gpu_type"], node["deployments"]) == ("b", "h100", ["chat", "embed"])


def test_registration_refuses_bad_input(cp_client: httpx.Client, agent: Headers, subtests: pytest.Subtests) -> None:
    cases: list[tuple[dict[str, Any], int]] = [
        ({"name": "n", "role": "router"}, 400),
        ({"name": "Not A Name"}, 422),
        ({"name": "n", "extra": 1}, 422),
    ]
    for body, status in cases:
        with subtests.test(body=body):
            response = cp_client.post("/v1/nodes/register", json=body, headers=agent)
            assert response.status_code == status, response.text


def test_heartbeat_stores_the_report_and_marks_the_node_seen(
    cp_client: httpx.Client, agent: Headers, cp_state: AppState
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    with cp_state.sessions() as session:
        session.execute(update(NodeRow).values(last_seen=utcnow() - timedelta(hours=1)))
        session.commit()
    report = {
        "inventory": [{"digest": "sha256:" + "a" * 64, "state": "ready", "bytes_total": 10, "bytes_present": 10}],
        "deployments": [{"name": "chat", "digest": "sha256:" + "a" * 64, "epoch": 3}],
        "counters": {"bytes_downloaded": 10, "chunks_rejected": 1},
        "health": {"disk_free": 5, "errors": ["slow disk"]},
    }
    response = cp_client.post(f"/v1/nodes/{node_id}/heartbeat", json=report, headers=agent)
    assert response.status_code == 204
    (node,) = cp_client.get("/v1/nodes", headers=agent).json()
    assert node["stale"] is False
    assert node["inventory"][0]["state"] == "ready"
    assert node["serving"] == [{"name": "chat", "digest": "sha256:" + "a" * 64, "epoch": 3, "hook": None}]
    assert (node["counters"]["bytes_downloaded"], node["counters"]["chunks_rejected"]) == (10, 1)
    assert node["health"]["errors"] == ["slow disk"]


def test_unknown_nodes_and_deployments_are_404(cp_client: httpx.Client, agent: Headers) -> None:
    heartbeat = cp_client.post("/v1/nodes/ghost/heartbeat", json={}, headers=agent)
    wanted = cp_client.get("/v1/nodes/ghost/desired", headers=agent)
    for response in (heartbeat, wanted):
        assert response.status_code == 404
        assert "register again" in problem(response)["detail"]
    status = cp_client.get("/v1/deployments/ghost/status", headers=agent)
    assert status.status_code == 404
    assert "ghost" in problem(status)["detail"]


def test_nodes_not_heard_from_within_the_stale_window_are_flagged_stale(
    cp_client: httpx.Client, agent: Headers, cp_state: AppState
) -> None:
    window = cp_state.settings.node_stale_seconds
    register(cp_client, agent, "fresh", "chat")
    register(cp_client, agent, "silent", "chat")
    register(cp_client, agent, "elsewhere", "embed")
    with cp_state.sessions() as session:
        session.execute(
            update(NodeRow).where(NodeRow.name == "silent").values(last_seen=utcnow() - timedelta(seconds=window + 5))
        )
        session.commit()
    nodes = {n["name"]: n["stale"] for n in cp_client.get("/v1/nodes", headers=agent).json()}
    assert nodes == {"elsewhere": False, "fresh": False, "silent": True}
    serving_chat = cp_client.get("/v1/nodes", params={"deployment": "chat"}, headers=agent).json()
    assert sorted(n["name"] for n in serving_chat) == ["fresh", "silent"]


# --- desired state ------------------------------------------------------------------------------


def test_desired_state_serves_stable_and_keeps_stable_previous_and_canary(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    v1, v2, v3 = chat["v1"], chat["v2"], chat["v3"]
    node_id = register(cp_client, agent, "gpu-1", "chat", "not-created-yet")
    state = desired(cp_client, agent, node_id)
    assert state["node_id"] == node_id
    assert state["deployments"] == [
        {"name": "chat", "model": "llama", "digest": v1, "epoch": 1, "role": "stable", "keep": [v1]}
    ]
    set_pointer(cp_client, operator, stable="v2")
    set_pointer(cp_client, operator, stable="v2", canary="v3", canary_share=1.0)
    (wanted,) = desired(cp_client, agent, node_id)["deployments"]
    assert (wanted["digest"], wanted["role"], wanted["epoch"], wanted["keep"]) == (v3, "canary", 3, [v2, v1, v3])
    set_pointer(cp_client, operator, stable="v2", canary="v3", canary_share=0.0)  # staged, no traffic
    (wanted,) = desired(cp_client, agent, node_id)["deployments"]
    assert (wanted["digest"], wanted["role"], wanted["keep"]) == (v2, "stable", [v2, v1, v3])


def test_nodes_the_hash_puts_in_the_canary_get_the_canary(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    set_pointer(cp_client, operator, stable="v1", canary="v2", canary_share=0.5)
    names = [f"gpu-{i}" for i in range(12)]
    for name in names:
        node_id = register(cp_client, agent, name, "chat")
        (wanted,) = desired(cp_client, agent, node_id)["deployments"]
        is_canary = in_canary("chat", name, 0.5)
        assert (wanted["role"], wanted["digest"]) == (
            ("canary", chat["v2"]) if is_canary else ("stable", chat["v1"])
        ), name


def test_revision_changes_exactly_when_the_desired_content_changes(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    first = desired(cp_client, agent, node_id)["revision"]
    cp_client.post(f"/v1/nodes/{node_id}/heartbeat", json={}, headers=agent)
    assert desired(cp_client, agent, node_id)["revision"] == first
    set_pointer(cp_client, operator, stable="v2")
    assert desired(cp_client, agent, node_id)["revision"] != first


# --- the canary subset (pure) --------------------------------------------------------------------

FLEET = [f"node-{i:04d}" for i in range(2000)]
SHARES = [0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]


def test_canary_buckets_are_fixed_per_pair_and_in_the_unit_interval() -> None:
    buckets = [canary_bucket("chat", name) for name in FLEET]
    assert all(0.0 <= b < 1.0 for b in buckets)
    assert buckets == [canary_bucket("chat", name) for name in FLEET]
    assert buckets != [canary_bucket("embed", name) for name in FLEET]  # each deployment its own subset


def test_canary_subset_only_grows_as_the_share_grows() -> None:
    previous: set[str] = set()
    for share in SHARES:
        subset = {name for name in FLEET if in_canary("chat", name, share)}
        assert previous <= subset, f"a node left the canary when the share grew to {share}"
        previous = subset
    assert previous == set(FLEET)


@pytest.mark.parametrize("share", SHARES)
def test_canary_subset_size_tracks_the_share(share: float) -> None:
    count = sum(in_canary("chat", name, share) for name in FLEET)
    n = len(FLEET)
    tolerance = 4 * math.sqrt(share * (1 - share) / n)  # four standard deviations of a binomial share
    assert abs(count / n - share) <= tolerance, (share, count)
    if share == 0.0:
        assert count == 0
    if share == 1.0:
        assert count == n


# --- status -------------------------------------------------------------------------------------


def test_status_counts_each_version_across_live_nodes(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str], cp_state: AppState
) -> None:
    v1, v2, v3 = chat["v1"], chat["v2"], chat["v3"]
    set_pointer(cp_client, operator, stable="v2")
    set_pointer(cp_client, operator, stable="v2", canary="v3", canary_share=0.5)

    def item(digest: str, state: str, present: int = 1000) -> dict[str, Any]:
        return {"digest": digest, "state": state, "bytes_total": 1000, "bytes_present": present}

    # name -> (inventory beside v1, which the node still serves unless it says "want")
    scenario: dict[str, tuple[str, int, bool]] = {
        "n0": ("ready", 1000, True),
        "n1": ("ready", 1000, True),
        "n2": ("fetching", 400, False),
        "n3": ("failed", 0, False),
        "n4": ("none", 0, False),  # registered, nothing reported yet
        "n5": ("ready", 1000, True),
    }
    wants: dict[str, str] = {}
    for name, (state, present, serves_want) in scenario.items():
        node_id = register(cp_client, agent, name, "chat")
        (wanted,) = desired(cp_client, agent, node_id)["deployments"]
        wants[name] = wanted["digest"]
        if state == "none":
            continue
        inventory = [item(v1, "ready"), item(wanted["digest"], state, present)]
        serving = wanted["digest"] if serves_want else v1
        body = {"inventory": inventory, "deployments": [{"name": "chat", "digest": serving, "epoch": 3}]}
        assert cp_client.post(f"/v1/nodes/{node_id}/heartbeat", json=body, headers=agent).status_code == 204
    register(cp_client, agent, "cache-0", "chat", role="cache")  # caches serve nothing: not counted
    register(cp_client, agent, "other-0", "embed")  # another deployment: not counted
    register(cp_client, agent, "gone-0", "chat")
    with cp_state.sessions() as session:
        session.execute(update(NodeRow).where(NodeRow.name == "gone-0").values(last_seen=utcnow() - timedelta(hours=1)))
        session.commit()

    response = cp_client.get("/v1/deployments/chat/status", headers=operator)
    assert response.status_code == 200, response.text
    status = response.json()
    assert status["deployment"]["epoch"] == 3
    assert (status["nodes"], status["stale_nodes"]) == (7, 1)
    assert status["lagging_nodes"] == ["n2", "n3", "n4"]
    by_digest = {v["digest"]: v for v in status["versions"]}
    assert [(v["digest"], v["role"]) for v in status["versions"]] == [
        (v2, "stable"),
        (v3, "canary"),
        (v1, "previous_stable"),
    ]
    for digest in (v2, v3):
        mine = [name for name, want in wants.items() if want == digest]
        reported = [name for name in mine if scenario[name][0] != "none"]
        got = by_digest[digest]
        assert got["nodes_desired"] == len(mine)
        for state in ("ready", "fetching", "failed"):
            assert got[f"nodes_{state}"] == sum(scenario[n][0] == state for n in mine), (digest, state)
        assert got["nodes_serving"] == sum(scenario[n][2] for n in mine)
        assert got["bytes_present"] == sum(scenario[n][1] for n in reported)
        assert got["bytes_total"] == 1000 * len(mine)  # reported totals, plus the size for n4
    old = by_digest[v1]
    assert (old["nodes_desired"], old["nodes_ready"], old["nodes_serving"]) == (0, 5, 2)


# --- long-poll ----------------------------------------------------------------------------------


def test_long_poll_answers_within_a_second_of_a_pointer_change(
    live_controlplane: Any, cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    revision = desired(cp_client, agent, node_id)["revision"]
    poll = BackgroundPoll(live_controlplane.url, agent, node_id, revision, wait=20)
    wait_until(lambda: waiting_polls(live_controlplane.state) >= 1, 10, "the long-poll parking")
    set_pointer(cp_client, operator, stable="v2")
    changed = time.monotonic()
    response = poll.join(timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["revision"] != revision
    assert body["deployments"][0]["digest"] == chat["v2"]
    latency = poll.arrived - changed
    assert latency < 1.0, f"long-poll answered {latency:.3f}s after the change"


def test_long_poll_sees_a_change_committed_by_another_replica(
    live_controlplane: Any,
    cp_client: httpx.Client,
    agent: Headers,
    chat: dict[str, str],
    cp_state: AppState,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The poll parks for its whole wait, not to its node's phase (which may come before the re-read).
    monkeypatch.setattr(fleet_routes, "expiry", lambda _node_id, _now, wait: wait)
    node_id = register(cp_client, agent, "gpu-1", "chat")
    revision = desired(cp_client, agent, node_id)["revision"]
    poll = BackgroundPoll(live_controlplane.url, agent, node_id, revision, wait=20)
    wait_until(lambda: waiting_polls(cp_state) >= 1, 10, "the long-poll parking")
    # Another replica's write: straight to the database, so this process's condition is never notified.
    with cp_state.sessions() as session:
        session.execute(update(DeploymentRow).where(DeploymentRow.name == "chat").values(stable=chat["v3"], epoch=2))
        session.commit()
    changed = time.monotonic()
    response = poll.join(timeout=10)
    assert response.json()["deployments"][0]["digest"] == chat["v3"]
    assert poll.arrived - changed < RECHECK_SECONDS + 1.0


def test_long_poll_without_a_change_answers_the_same_revision_when_wait_runs_out(
    cp_client: httpx.Client, agent: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    revision = desired(cp_client, agent, node_id)["revision"]
    started = time.monotonic()
    body = desired(cp_client, agent, node_id, after=revision, wait=0.5)
    elapsed = time.monotonic() - started
    assert body["revision"] == revision
    assert 0.45 <= elapsed < 5


def test_long_poll_wait_is_capped_by_the_server(
    cp_client: httpx.Client, agent: Headers, chat: dict[str, str], cp_state: AppState
) -> None:
    cp_state.settings = dataclasses.replace(cp_state.settings, long_poll_max_seconds=0.3)
    node_id = register(cp_client, agent, "gpu-1", "chat")
    revision = desired(cp_client, agent, node_id)["revision"]
    started = time.monotonic()
    assert desired(cp_client, agent, node_id, after=revision, wait=600)["revision"] == revision
    assert time.monotonic() - started < 5


def test_long_poll_with_a_stale_revision_answers_at_once(
    cp_client: httpx.Client, agent: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    started = time.monotonic()
    body = desired(cp_client, agent, node_id, after="an-old-revision", wait=20)
    assert body["deployments"][0]["digest"] == chat["v1"]
    assert time.monotonic() - started < 5
