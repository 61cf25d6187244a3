"""Change notification in one process: parked long-polls wake exactly when their state moved, cost no
queries while parked, and token revocation is prompt despite the auth cache."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import text, update

from controlplane import snapshot
from controlplane.authcache import TokenCache
from controlplane.notify import CHANNEL, DEPLOYMENTS, RESYNC, token_topic
from controlplane.persistence.engine import query_count
from controlplane.persistence.rows import DeploymentRow, TokenRow
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
from weightship.testing import ManualClock

pytestmark = pytest.mark.timeout(90)


def test_a_pointer_change_answers_only_the_polls_on_that_deployment(
    live_controlplane: Any, cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    assert (
        cp_client.post("/v1/deployments", json={"name": "embed", "model": "llama"}, headers=operator).status_code == 201
    )
    set_pointer(cp_client, operator, name="embed", stable="v1")
    on_chat = park(live_controlplane.url, agent, cp_client, register(cp_client, agent, "gpu-chat", "chat"))
    on_embed = park(live_controlplane.url, agent, cp_client, register(cp_client, agent, "gpu-embed", "embed"))
    wait_until(lambda: waiting_polls(live_controlplane.state) == 2, 10, "both long-polls parking")

    set_pointer(cp_client, operator, stable="v2")

    assert on_chat.join(timeout=10).json()["deployments"][0]["digest"] == chat["v2"]
    assert on_embed.response is None, "a poll on an unaffected deployment was answered"
    assert waiting_polls(live_controlplane.state) == 1
    set_pointer(cp_client, operator, name="embed", stable="v3")
    assert on_embed.join(timeout=10).json()["deployments"][0]["digest"] == chat["v3"]


def test_parked_and_reparking_long_polls_issue_no_queries(
    quiet_recheck: None, live_controlplane: Any, cp_client: httpx.Client, agent: Headers, chat: dict[str, str]
) -> None:
    state: AppState = live_controlplane.state
    nodes = [register(cp_client, agent, f"gpu-{i}", "chat") for i in range(20)]
    # Short waits, so polls time out and come back (with ``after``) many times within the window.
    revisions = {node_id: desired(cp_client, agent, node_id)["revision"] for node_id in nodes}
    for node_id, revision in revisions.items():  # first long-polls: the node's identity is read once
        BackgroundPoll(live_controlplane.url, agent, node_id, revision, wait=0.1).join(timeout=10)
    before = query_count(state.engine)
    polls = [(rev, BackgroundPoll(live_controlplane.url, agent, n, rev, wait=0.2)) for n, rev in revisions.items()] * 3
    for revision, poll in polls:
        assert poll.join(timeout=10).json()["revision"] == revision
    assert query_count(state.engine) == before, "long-polls on unchanged state went to the database"


def test_a_pointer_change_costs_one_read_however_many_polls_are_parked(
    quiet_recheck: None, live_controlplane: Any, cp_client: httpx.Client, agent: Headers, operator: Headers,
    chat: dict[str, str],
) -> None:  # fmt: skip
    state: AppState = live_controlplane.state
    costs = []
    for count, stable in ((2, "v2"), (30, "v3")):
        polls = [
            park(live_controlplane.url, agent, cp_client, register(cp_client, agent, f"n{count}-{i}", "chat"))
            for i in range(count)
        ]
        wait_until(lambda n=count: waiting_polls(state) == n, 10, "every long-poll parking")  # type: ignore[misc]
        before = query_count(state.engine)
        set_pointer(cp_client, operator, stable=stable)
        for poll in polls:
            assert poll.join(timeout=10).json()["deployments"][0]["digest"] == chat[stable]
        costs.append(query_count(state.engine) - before)
    assert costs[0] == costs[1], f"queries per pointer change grew with the parked polls: {costs}"


def test_a_revoked_token_stops_working_on_the_next_request(cp_client: httpx.Client, admin_headers: Headers) -> None:
    minted = cp_client.post("/v1/tokens", json={"name": "on-call", "role": "operator"}, headers=admin_headers).json()
    headers = {"Authorization": f"Bearer {minted['token']}"}
    for _ in range(2):  # the second is answered from the cache
        assert cp_client.get("/v1/nodes", headers=headers).status_code == 200
    assert cp_client.delete(f"/v1/tokens/{minted['id']}", headers=admin_headers).status_code == 204
    response = cp_client.get("/v1/nodes", headers=headers)
    assert response.status_code == 401
    assert "revoked" in problem(response)["detail"]


def test_token_cache_trusts_an_entry_for_its_ttl_only() -> None:
    clock = ManualClock()
    cache: TokenCache[str] = TokenCache(ttl=30, clock=clock)
    cache.put("Bearer a", "alice", "tok-a")
    clock.now += 29.9
    assert cache.get("Bearer a") == "alice"
    clock.now += 0.2
    assert cache.get("Bearer a") is None


@pytest.mark.parametrize(
    ("topic", "left"),
    [(token_topic("tok-a"), {"Bearer b"}), (RESYNC, set()), (DEPLOYMENTS, {"Bearer a", "Bearer a2", "Bearer b"})],
    ids=["revoked", "resync", "unrelated"],
)
def test_token_cache_forgets_what_the_change_feed_says(topic: str, left: set[str]) -> None:
    cache: TokenCache[str] = TokenCache(ttl=30, clock=ManualClock())
    for header, token_id in (("Bearer a", "tok-a"), ("Bearer a2", "tok-a"), ("Bearer b", "tok-b")):
        cache.put(header, header, token_id)
    cache.on_change(topic)
    assert {h for h in ("Bearer a", "Bearer a2", "Bearer b") if cache.get(h)} == left


def test_a_plain_read_right_after_a_pointer_change_shows_it(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, str]
) -> None:
    node_id = register(cp_client, agent, "gpu-1", "chat")
    for stable in ("v2", "v3", "v1", "v2"):
        set_pointer(cp_client, operator, stable=stable)
        assert desired(cp_client, agent, node_id)["deployments"][0]["digest"] == chat[stable]


def test_a_dropped_listen_connection_reconnects_and_catches_up(
    quiet_recheck: None,
    live_controlplane: Any,
    cp_client: httpx.Client,
    agent: Headers,
    chat: dict[str, str],
    cp_state: AppState,
) -> None:
    if cp_state.engine.dialect.name != "postgresql":
        pytest.skip("the LISTEN connection exists on PostgreSQL only")
    poll = park(live_controlplane.url, agent, cp_client, register(cp_client, agent, "gpu-1", "chat"))
    wait_until(lambda: waiting_polls(cp_state) == 1, 10, "the long-poll parking")
    with cp_state.engine.begin() as conn:
        killed = conn.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")
        ).all()
    assert killed, "no LISTEN connection found"
    # Another replica's change, announced while this one may not be listening yet.
    with cp_state.engine.begin() as conn:
        conn.execute(update(DeploymentRow).where(DeploymentRow.name == "chat").values(stable=chat["v3"], epoch=2))
        conn.execute(text("SELECT pg_notify(:channel, 'another-replica|deployments')"), {"channel": CHANNEL})
    assert poll.join(timeout=10).json()["deployments"][0]["digest"] == chat["v3"]


@pytest.fixture
def fast_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop re-read every 0.1 s (list it before ``live_controlplane``)."""
    monkeypatch.setattr(snapshot, "RECHECK_SECONDS", 0.1)


def test_a_token_revoked_without_an_announcement_stops_working_at_the_next_recheck(
    fast_recheck: None, live_controlplane: Any, cp_client: httpx.Client, admin_headers: Headers, cp_state: AppState
) -> None:
    minted = cp_client.post("/v1/tokens", json={"name": "on-call", "role": "operator"}, headers=admin_headers).json()
    headers = {"Authorization": f"Bearer {minted['token']}"}
    assert cp_client.get("/v1/nodes", headers=headers).status_code == 200  # cached now
    with cp_state.engine.begin() as conn:  # as a replica whose announcement was lost would leave it
        conn.execute(update(TokenRow).where(TokenRow.id == minted["id"]).values(revoked=True))
    wait_until(lambda: cp_client.get("/v1/nodes", headers=headers).status_code == 401, 10, "the revocation to be seen")
