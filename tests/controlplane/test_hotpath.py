"""A node's own heartbeats and long-polls (``controlplane.http.hotpath``) answer exactly as the routes do.

Every request below is made with the node's own node token, which the first request puts in the
token cache, so it reaches the hot path; each answer is compared with the one the full
application gives (an admin token, or the first, uncached request), byte for byte where the
answer does not depend on the caller.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import delete

from controlplane.persistence.rows import NodeRow, TokenRow
from controlplane.state import AppState
from tests.controlplane.fleet_parts import Headers, set_pointer
from weightship.testing import problem

REPORT: dict[str, Any] = {
    "inventory": [{"digest": "sha256:" + "a" * 64, "state": "ready", "bytes_total": 10, "bytes_present": 10}],
    "deployments": [{"name": "chat", "digest": "sha256:" + "a" * 64, "epoch": 3}],
    "counters": {"bytes_downloaded": 10},
    "health": {"disk_free": 5, "errors": []},
}


class Node:
    """An enrolled node: its id and its node token's header."""

    def __init__(self, client: httpx.Client, admin: Headers, name: str) -> None:
        created = client.post("/v1/tokens", json={"name": f"enrol-{name}", "role": "agent"}, headers=admin)
        assert created.status_code == 201, created.text
        enrolled = client.post(
            "/v1/nodes/enrol",
            json={"name": name, "deployments": ["chat"]},
            headers={"Authorization": f"Bearer {created.json()['token']}"},
        )
        assert enrolled.status_code == 201, enrolled.text
        self.id: str = enrolled.json()["node"]["id"]
        self.headers = {"Authorization": f"Bearer {enrolled.json()['token']}"}


@pytest.fixture
def node(cp_client: httpx.Client, admin_headers: Headers, chat: dict[str, str]) -> Node:
    """Node ``gpu-1`` of deployment ``chat``, its token already in the cache (one heartbeat sent)."""
    enrolled = Node(cp_client, admin_headers, "gpu-1")
    assert (
        cp_client.post(f"/v1/nodes/{enrolled.id}/heartbeat", json=REPORT, headers=enrolled.headers).status_code == 204
    )
    return enrolled


def test_a_nodes_heartbeat_is_stored_and_its_long_poll_answers_as_the_route_does(
    cp_client: httpx.Client, admin_headers: Headers, operator: Headers, node: Node
) -> None:
    report = {**REPORT, "counters": {"bytes_downloaded": 99}}
    assert cp_client.post(f"/v1/nodes/{node.id}/heartbeat", json=report, headers=node.headers).status_code == 204
    (info,) = cp_client.get("/v1/nodes", headers=admin_headers).json()
    assert info["counters"]["bytes_downloaded"] == 99

    url = f"/v1/nodes/{node.id}/desired"
    hot = cp_client.get(url, params={"after": "old", "wait": "0"}, headers=node.headers)
    routed = cp_client.get(url, params={"after": "old", "wait": "0"}, headers=admin_headers)
    assert (hot.status_code, hot.headers["content-type"], hot.content) == (
        routed.status_code,
        routed.headers["content-type"],
        routed.content,
    )
    revision = hot.json()["revision"]
    # a parked poll of the hot path hears a pointer change, and says when to come back
    with httpx.Client(base_url=str(cp_client.base_url), timeout=30) as poller:
        pending = poller.build_request("GET", url, params={"after": revision, "wait": "20"}, headers=node.headers)
        set_pointer(cp_client, operator, stable="v2")
        answered = poller.send(pending)
    assert answered.status_code == 200
    assert answered.json()["revision"] != revision
    assert float(answered.headers.get("poll-after", "0")) >= 0


@pytest.mark.parametrize(
    ("what", "request_args"),
    [
        ("a heartbeat that does not validate", {"method": "POST", "tail": "heartbeat", "json": {"inventory": 5}}),
        ("a heartbeat that is not JSON", {"method": "POST", "tail": "heartbeat", "content": b"{nope"}),
        ("a wait that is not a number", {"method": "GET", "tail": "desired", "params": {"wait": "soon"}}),
        ("a wait over an hour", {"method": "GET", "tail": "desired", "params": {"wait": "3601"}}),
        ("an after over 128 characters", {"method": "GET", "tail": "desired", "params": {"after": "x" * 129}}),
    ],
)
def test_bad_input_from_a_node_gets_the_routes_own_problem(
    cp_client: httpx.Client, admin_headers: Headers, node: Node, what: str, request_args: dict[str, Any]
) -> None:
    args = dict(request_args)
    method, tail = args.pop("method"), args.pop("tail")
    url = f"/v1/nodes/{node.id}/{tail}"
    hot = cp_client.request(method, url, headers=node.headers, **args)
    routed = cp_client.request(method, url, headers=admin_headers, **args)
    assert hot.status_code == routed.status_code == 422, what
    assert problem(hot) == problem(routed)


def test_a_heartbeat_over_the_limit_is_refused_with_413(cp_client: httpx.Client, node: Node) -> None:
    big = {**REPORT, "health": {"disk_free": 5, "errors": ["x" * 1024] * 1100}}
    response = cp_client.post(f"/v1/nodes/{node.id}/heartbeat", json=big, headers=node.headers)
    assert response.status_code == 413
    assert problem(response)["code"] == "too_large"


def test_a_chunked_heartbeat_without_a_length_is_stored(
    cp_client: httpx.Client, admin_headers: Headers, node: Node
) -> None:
    def body() -> Iterator[bytes]:
        yield json.dumps({**REPORT, "counters": {"bytes_downloaded": 7}}).encode()

    response = cp_client.post(f"/v1/nodes/{node.id}/heartbeat", content=body(), headers=node.headers)
    assert response.status_code == 204
    (info,) = cp_client.get("/v1/nodes", headers=admin_headers).json()
    assert info["counters"]["bytes_downloaded"] == 7


def test_a_node_token_naming_another_node_is_refused_with_403(
    cp_client: httpx.Client, admin_headers: Headers, node: Node
) -> None:
    other = Node(cp_client, admin_headers, "gpu-2")
    heartbeat = cp_client.post(f"/v1/nodes/{other.id}/heartbeat", json=REPORT, headers=node.headers)
    wanted = cp_client.get(f"/v1/nodes/{other.id}/desired", headers=node.headers)
    for response in (heartbeat, wanted):
        assert response.status_code == 403
        assert problem(response)["code"] == "other_node"


def test_a_node_removed_behind_its_cached_token_gets_404(
    cp_client: httpx.Client, cp_state: AppState, node: Node
) -> None:
    with cp_state.sessions() as session:
        session.execute(delete(TokenRow).where(TokenRow.node_id == node.id))  # still in the token cache
        session.execute(delete(NodeRow).where(NodeRow.id == node.id))
        session.commit()
    cp_state.fleet.reports_written.clear()
    heartbeat = cp_client.post(f"/v1/nodes/{node.id}/heartbeat", json=REPORT, headers=node.headers)
    wanted = cp_client.get(f"/v1/nodes/{node.id}/desired", headers=node.headers)
    for response in (heartbeat, wanted):
        assert response.status_code == 404, response.text
        assert "register again" in problem(response)["detail"]
