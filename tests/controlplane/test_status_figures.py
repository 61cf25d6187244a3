"""``weightship status`` figures: origin egress wherever it happened, delivered bytes only where they serve."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from controlplane.persistence.rows import NodeRow, utcnow
from controlplane.state import AppState
from tests.controlplane.fleet_parts import register

pytestmark = pytest.mark.timeout(60)

Headers = dict[str, str]


def _beat(client: httpx.Client, headers: Headers, node_id: str, **sources: int) -> None:
    body = {"counters": {"sources": {name: {"bytes": n, "chunks": 1} for name, n in sources.items()}}}
    assert client.post(f"/v1/nodes/{node_id}/heartbeat", json=body, headers=headers).status_code == 204


def test_origin_egress_counts_the_caches_reads_and_delivered_counts_only_serving_nodes(
    cp_client: httpx.Client, agent: Headers, operator: Headers, chat: dict[str, Any], cp_state: AppState
) -> None:
    for name, sources in {"n0": {"cluster_cache": 700, "peer": 300}, "n1": {"peer": 900, "origin": 100}}.items():
        _beat(cp_client, agent, register(cp_client, agent, name, "chat"), **sources)
    # The cluster cache read 800 bytes from the origin for its children, and 50 more from its region cache.
    _beat(cp_client, agent, register(cp_client, agent, "cache-0", role="cache"), origin=800, region_cache=50)
    # A cache that went silent no longer counts, nor does a node of another deployment.
    _beat(cp_client, agent, register(cp_client, agent, "cache-old", role="cache"), origin=5000)
    _beat(cp_client, agent, register(cp_client, agent, "other-0", "embed"), origin=7000)
    with cp_state.sessions() as session:
        session.execute(update(NodeRow).where(NodeRow.name == "cache-old").values(last_seen=utcnow() - timedelta(hours=1)))
        session.commit()

    status = cp_client.get("/v1/deployments/chat/status", headers=operator).json()

    assert status["origin_bytes"] == 100 + 800
    assert status["delivered_bytes"] == 700 + 300 + 900 + 100
