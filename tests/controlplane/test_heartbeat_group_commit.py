"""Heartbeats are group-committed: many share one transaction, each answered only once it is stored.

The database is held busy by a transaction of the test's own (SQLite: the write lock;
PostgreSQL: every node row locked), so heartbeats sent meanwhile queue behind the one in flight,
deterministically; releasing it lets them commit, or, past the lock timeout, fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, update

from controlplane.persistence.rows import NodeRow, utcnow
from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.conftest import LiveControlPlane, problem
from weightship.schemas import Role
from weightship.testing import eventually

pytestmark = pytest.mark.timeout(90)

Headers = dict[str, str]
NODES = 30


@pytest.fixture
def lock_timeout() -> float:
    """How long a write waits for the test's lock before failing (tests parametrize it)."""
    return 20.0


@pytest.fixture
def cp_settings(cp_settings: Settings, lock_timeout: float) -> Settings:
    """The shared settings, with this module's lock timeout."""
    return dataclasses.replace(cp_settings, database_lock_timeout_seconds=lock_timeout)


@pytest.fixture
def nodes(cp_client: httpx.Client, role_headers: dict[Role, Headers]) -> list[str]:
    """``NODES`` registered nodes' ids."""
    ids = []
    for i in range(NODES):
        response = cp_client.post("/v1/nodes/register", json={"name": f"gpu-{i}"}, headers=role_headers[Role.admin])
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    return ids


def report(downloaded: int) -> dict[str, Any]:
    """A heartbeat body whose counters tell which one it was."""
    return {"counters": {"bytes_downloaded": downloaded}}


@contextmanager
def database_held(state: AppState) -> Iterator[None]:
    """Hold every node row (PostgreSQL) or the write lock (SQLite) in an open transaction until exit."""
    with state.engine.connect() as conn:
        conn.execute(update(NodeRow).values(last_seen=utcnow()))
        try:
            yield
        finally:
            conn.rollback()


def heartbeat_all(url: str, headers: Headers, bodies: dict[str, dict[str, Any]]) -> dict[str, httpx.Response]:
    """One heartbeat per node, all at once; the responses by node id."""

    async def send() -> dict[str, httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies) + 1)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
            posts = [client.post(f"/v1/nodes/{node}/heartbeat", json=body) for node, body in bodies.items()]
            return dict(zip(bodies, await asyncio.gather(*posts), strict=True))

    return asyncio.run(send())


def stored_counters(state: AppState) -> dict[str, int | None]:
    """Each node's stored ``bytes_downloaded``, by node id."""
    with state.sessions() as session:
        rows = session.execute(select(NodeRow.id, NodeRow.report)).all()
    return {node: (report or {}).get("counters", {}).get("bytes_downloaded") for node, report in rows}


def heartbeat_all_queued(
    state: AppState, url: str, headers: Headers, bodies: dict[str, dict[str, Any]]
) -> dict[str, httpx.Response]:
    """``heartbeat_all`` while the database is held until every heartbeat has queued; then released."""
    with ThreadPoolExecutor(1) as pool:
        with database_held(state):
            sent = pool.submit(heartbeat_all, url, headers, bodies)
            # A batch waits on the lock, every later heartbeat queues behind it.
            eventually(lambda: state.heartbeats.queued >= len(bodies), 30, "the heartbeats queueing")
        return sent.result(timeout=60)


def test_concurrent_heartbeats_are_all_stored_in_far_fewer_transactions(
    live_controlplane: LiveControlPlane, cp_state: AppState, role_headers: dict[Role, Headers], nodes: list[str]
) -> None:
    commits: list[int] = []
    event.listen(cp_state.engine, "commit", lambda _conn: commits.append(1))
    bodies = {node: report(i + 1) for i, node in enumerate(nodes)}
    responses = heartbeat_all_queued(cp_state, live_controlplane.url, role_headers[Role.admin], bodies)
    assert {node: r.status_code for node, r in responses.items()} == dict.fromkeys(nodes, 204)
    assert stored_counters(cp_state) == {node: body["counters"]["bytes_downloaded"] for node, body in bodies.items()}
    assert 1 <= len(commits) <= 2, f"{NODES} heartbeats took {len(commits)} transactions"


@pytest.mark.parametrize("lock_timeout", [0.5])
def test_a_failed_batch_answers_every_member_503_and_loses_nothing_stored(
    live_controlplane: LiveControlPlane,
    cp_client: httpx.Client,
    cp_state: AppState,
    role_headers: dict[Role, Headers],
    nodes: list[str],
) -> None:
    admin = role_headers[Role.admin]
    first = {node: report(1) for node in nodes}
    assert {r.status_code for r in heartbeat_all(live_controlplane.url, admin, first).values()} == {204}
    second = {node: report(2) for node in nodes}
    with database_held(cp_state):
        refused = heartbeat_all(live_controlplane.url, admin, second)
    for response in refused.values():
        assert response.status_code == 503, response.text
        assert problem(response)["code"] == "database_unavailable"
        assert "retry-after" in response.headers
    assert stored_counters(cp_state) == dict.fromkeys(nodes, 1)  # what was stored stays; nothing half-written
    # Sent again, the refused reports are stored: a refusal left no memo claiming they were written.
    assert {r.status_code for r in heartbeat_all(live_controlplane.url, admin, second).values()} == {204}
    assert stored_counters(cp_state) == dict.fromkeys(nodes, 2)


def test_an_unknown_node_in_a_batch_gets_404_and_the_others_are_stored(
    live_controlplane: LiveControlPlane, cp_state: AppState, role_headers: dict[Role, Headers], nodes: list[str]
) -> None:
    bodies = {node: report(7) for node in nodes} | {"ghost": report(7)}
    responses = heartbeat_all_queued(cp_state, live_controlplane.url, role_headers[Role.admin], bodies)
    assert responses["ghost"].status_code == 404
    assert problem(responses["ghost"])["code"] == "node_not_registered"
    assert {responses[node].status_code for node in nodes} == {204}
    assert stored_counters(cp_state) == dict.fromkeys(nodes, 7)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"", b'{"counters": {"bytes_downloaded": "many"}}', b'{"inventory": [{"digest": "md5:0"}]}'],
)
def test_a_malformed_heartbeat_is_refused_422_and_the_stored_report_stays(
    cp_client: httpx.Client, cp_state: AppState, role_headers: dict[Role, Headers], nodes: list[str], body: bytes
) -> None:
    admin = role_headers[Role.admin]
    node = nodes[0]
    assert cp_client.post(f"/v1/nodes/{node}/heartbeat", json=report(5), headers=admin).status_code == 204
    response = cp_client.post(
        f"/v1/nodes/{node}/heartbeat", content=body, headers={**admin, "Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert problem(response)["code"] == "invalid_request"
    assert problem(response)["detail"].startswith("body")
    assert stored_counters(cp_state)[node] == 5
