"""Preheats and warm pools across two control-plane processes on one PostgreSQL.

A preheat or warm pool written through one replica reaches the long-polls parked on the other
through the change feed (``staging``), within the second the fleet needs; the parked polls of
nodes the change does not match stay parked.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.agent.controlplane_process import ControlPlaneProcess
from tests.controlplane.fleet_parts import BackgroundPoll
from tests.controlplane.replica_parts import ADMIN, seed, set_stable
from weightship.testing import eventually as poll_until

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.postgres,
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
]


def register(http: httpx.Client, name: str, cluster: str) -> tuple[str, str]:
    """Register a node (no deployments) in ``cluster``; its id and current revision."""
    node_id: str = http.post(
        "/v1/nodes/register", json={"name": name, "labels": {"cluster": cluster}}, headers=ADMIN
    ).json()["id"]
    return node_id, http.get(f"/v1/nodes/{node_id}/desired", headers=ADMIN).json()["revision"]


def test_a_preheat_and_a_warm_pool_written_through_one_replica_wake_the_matching_polls_on_another(
    replicas: tuple[ControlPlaneProcess, ControlPlaneProcess], database_url: str
) -> None:
    writer, holder = replicas
    digests = seed(database_url, "llama", ("v1", "v2"))
    with (
        httpx.Client(base_url=writer.url, timeout=30) as via_writer,
        httpx.Client(base_url=holder.url, timeout=30) as via_holder,
    ):
        assert via_writer.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN).is_success
        set_stable(via_writer, "v1")
        warm_id, warm_rev = register(via_holder, "warm-1", "warm")
        cold_id, cold_rev = register(via_holder, "cold-1", "cold")
        warm = BackgroundPoll(holder.url, ADMIN, warm_id, warm_rev, wait=30)
        cold = BackgroundPoll(holder.url, ADMIN, cold_id, cold_rev, wait=30)
        poll_until(lambda: holder.parked() == 2, 30, "both long-polls parking on the second replica")

        pool = via_writer.put("/v1/deployments/chat/warm-pool", json={"selector": {"cluster": "warm"}}, headers=ADMIN)
        written = time.monotonic()

        assert pool.status_code == 200, pool.text
        body = warm.join(timeout=30).json()
        assert [s["digest"] for s in body["stage"]] == [digests["v1"]]
        assert warm.arrived - written < 1.0, f"the other replica answered {warm.arrived - written:.3f}s after"
        assert cold.response is None, "a node the warm pool does not match was answered"

        # A pointer move re-stages the warm pool: the new stable joins (the old one leaves the pool).
        warm = BackgroundPoll(holder.url, ADMIN, warm_id, body["revision"], wait=30)
        poll_until(lambda: holder.parked() == 2, 30, "the warm poll parking again")
        set_stable(via_writer, "v2")
        assert [s["digest"] for s in warm.join(timeout=30).json()["stage"]] == [digests["v2"]]

        made = via_writer.post("/v1/deployments/chat/preheats", json={"version": "v1", "selector": {"cluster": "cold"}},
                               headers=ADMIN)  # fmt: skip
        assert made.status_code == 201, made.text
        assert [s["digest"] for s in cold.join(timeout=30).json()["stage"]] == [digests["v1"]]
