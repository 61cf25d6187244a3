"""Per-version traffic from heartbeats: windows summed over nodes, counter resets, no data, /metrics signals."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import delete

from controlplane.persistence.rows import NodeRow, ServeSampleRow, utcnow
from controlplane.state import AppState
from controlplane.traffic import take_sample, window
from tests.controlplane.conftest import SeedVersions
from tests.controlplane.fleet_parts import register, set_pointer
from tests.controlplane.traffic_reports import Served, heartbeat
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(60)

Headers = dict[str, str]
SINCE = "2026-12-01T06:00:00+00:00"
#: windows are read with a generous staleness: the test's clock runs ahead of the heartbeats
STALE = 3600.0


@pytest.fixture
def admin(role_headers: dict[Role, Headers]) -> Headers:
    return role_headers[Role.admin]


@pytest.fixture
def chat(cp_client: httpx.Client, admin: Headers, seed_versions: SeedVersions) -> dict[str, str]:
    """Deployment ``chat`` at stable v1 with v2 as a 50 % canary; returns the digests."""
    digests = seed_versions("llama")
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=admin).status_code == 201
    set_pointer(cp_client, admin, stable="v1")
    set_pointer(cp_client, admin, stable="v1", canary="v2", canary_share=0.5)
    return digests


def sample(state: AppState, at: datetime) -> None:
    with state.sessions() as session:
        take_sample(session, at, STALE, 7200.0)


def read_window(state: AppState, at: datetime, seconds: float = 60.0) -> dict[str, tuple[int, int]]:
    """{digest: (requests, errors)} of chat over the window ending at ``at``."""
    with state.sessions() as session:
        found = window(session, "chat", seconds, at, STALE)
    assert found is not None
    return {digest: (t.requests, t.errors) for digest, t in found.versions.items()}


def test_window_sums_each_version_over_the_nodes_serving_it(
    cp_client: httpx.Client, cp_state: AppState, admin: Headers, chat: dict[str, str]
) -> None:
    v1, v2 = chat["v1"], chat["v2"]
    a, b, c = (register(cp_client, admin, name, "chat") for name in ("node-a", "node-b", "node-c"))
    a1, b1, c2 = Served(v1), Served(v1), Served(v2)
    a1.grow(100, 0.02)  # before the window: must not count
    c2.grow(40, 0.3, errors=4)
    for node, served in ((a, a1), (b, b1), (c, c2)):
        heartbeat(cp_client, admin, node, SINCE, [served])
    t0 = utcnow()
    sample(cp_state, t0)
    a1.grow(200, 0.02, errors=2)
    b1.grow(50, 0.04, errors=1)
    c2.grow(100, 0.3, errors=10)
    for node, served in ((a, a1), (b, b1), (c, c2)):
        heartbeat(cp_client, admin, node, SINCE, [served])

    assert read_window(cp_state, t0 + timedelta(seconds=60)) == {v1: (250, 3), v2: (100, 10)}


def test_a_restarted_agent_counts_its_new_run_whole_and_never_negative(
    cp_client: httpx.Client, cp_state: AppState, admin: Headers, chat: dict[str, str]
) -> None:
    v1, v2 = chat["v1"], chat["v2"]
    a, b = register(cp_client, admin, "node-a", "chat"), register(cp_client, admin, "node-b", "chat")
    a1, b2 = Served(v1), Served(v2)
    a1.grow(1000, 0.02, errors=50)
    b2.grow(500, 0.02)
    heartbeat(cp_client, admin, a, SINCE, [a1])
    heartbeat(cp_client, admin, b, SINCE, [b2])
    t0 = utcnow()
    sample(cp_state, t0)
    # node-a's agent restarted (a new ``since``): 30 requests since, fewer than before the restart.
    restarted = Served(v1)
    restarted.grow(30, 0.02, errors=3)
    heartbeat(cp_client, admin, a, "2026-12-01T06:30:00+00:00", [restarted])
    # node-b's counters went down under the same ``since`` (an entry evicted and re-created): a reset too.
    b2_again = Served(v2)
    b2_again.grow(20, 0.02)
    heartbeat(cp_client, admin, b, SINCE, [b2_again])

    assert read_window(cp_state, t0 + timedelta(seconds=60)) == {v1: (30, 3), v2: (20, 0)}


def test_no_data_until_samples_cover_half_the_window(
    cp_client: httpx.Client, cp_state: AppState, admin: Headers, chat: dict[str, str]
) -> None:
    node = register(cp_client, admin, "node-a", "chat")
    heartbeat(cp_client, admin, node, SINCE, [Served(chat["v1"])])
    with cp_state.sessions() as session:
        session.execute(delete(ServeSampleRow))  # no sample at all, as just after a first start
        oldest = utcnow()
        take_sample(session, oldest, STALE, 7200.0)
        assert window(session, "chat", 600.0, oldest + timedelta(seconds=299), STALE) is None
        assert window(session, "chat", 600.0, oldest + timedelta(seconds=300), STALE) is not None


def test_stale_nodes_add_nothing(
    cp_client: httpx.Client, cp_state: AppState, admin: Headers, chat: dict[str, str]
) -> None:
    node = register(cp_client, admin, "node-a", "chat")
    served = Served(chat["v1"])
    served.grow(10, 0.02)
    heartbeat(cp_client, admin, node, SINCE, [served])
    t0 = utcnow()
    sample(cp_state, t0)
    with cp_state.sessions() as session:
        found = window(session, "chat", 60.0, t0 + timedelta(seconds=60), stale_seconds=30.0)
    assert found is not None
    assert found.versions == {}


def test_metrics_export_queue_depth_rate_latency_and_staged_capacity(
    cp_client: httpx.Client, cp_state: AppState, admin: Headers, chat: dict[str, str]
) -> None:
    v1, v2 = chat["v1"], chat["v2"]
    a, b, warm = (register(cp_client, admin, name, "chat") for name in ("node-a", "node-b", "node-warm"))
    a1, b2 = Served(v1, queue_depth=3), Served(v2, queue_depth=1)
    heartbeat(cp_client, admin, a, SINCE, [a1], deployments=[{"name": "chat", "digest": v1, "epoch": 2}])
    heartbeat(cp_client, admin, b, SINCE, [b2], deployments=[{"name": "chat", "digest": v2, "epoch": 2}])
    sample(cp_state, utcnow() - timedelta(seconds=60))
    a1.grow(120, 0.03)
    b2.grow(60, 0.6, errors=6)
    heartbeat(cp_client, admin, a, SINCE, [a1], deployments=[{"name": "chat", "digest": v1, "epoch": 2}])
    heartbeat(cp_client, admin, b, SINCE, [b2], deployments=[{"name": "chat", "digest": v2, "epoch": 2}])
    # node-warm holds v1 verified but serves nothing yet: warm capacity.
    held = {"digest": v1, "state": "ready", "bytes_total": 1000, "bytes_present": 1000}
    response = cp_client.post(
        f"/v1/nodes/{warm}/heartbeat",
        json={"inventory": [held], "deployments": [{"name": "chat", "digest": None, "epoch": 0}]},
        headers=admin,
    )
    assert response.status_code == 204

    scraped = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(cp_client.get("/metrics").text)
        for s in family.samples
    }

    def value(name: str, version: str, **labels: str) -> float:
        return scraped[(name, tuple(sorted({"deployment": "chat", "version": version, **labels}.items())))]

    assert value("weightship_deployment_queue_depth", v1) == 3
    assert value("weightship_deployment_queue_depth", v2) == 1
    assert 120 / 62 <= value("weightship_deployment_request_rate", v1) <= 120 / 59
    assert value("weightship_deployment_error_ratio", v2) == pytest.approx(0.1)
    assert 0.025 < value("weightship_deployment_latency_seconds", v1, quantile="0.5") <= 0.05
    assert 0.5 < value("weightship_deployment_latency_seconds", v2, quantile="0.99") <= 1.0
    assert value("weightship_deployment_serving_nodes", v1) == 1
    assert value("weightship_deployment_serving_nodes", v2) == 1
    assert value("weightship_deployment_staged_capacity_nodes", v1) == 1


def test_a_malformed_serve_report_is_refused_naming_the_field_and_stores_nothing(
    cp_client: httpx.Client, cp_state: AppState, admin: Headers, chat: dict[str, str]
) -> None:
    node = register(cp_client, admin, "node-a", "chat")
    entry = {**Served(chat["v1"]).body(), "requests": 5, "latency_le": [5, 4] + [4] * 10}
    response = cp_client.post(
        f"/v1/nodes/{node}/heartbeat", json={"serve": {"since": SINCE, "versions": [entry]}}, headers=admin
    )
    assert response.status_code == 422
    assert "latency_le" in response.text
    with cp_state.sessions() as session:
        assert (session.get(NodeRow, node) or NodeRow()).report.get("serve") is None
