"""Several control-plane processes on one PostgreSQL: a change made through one reaches the others.

Two real ``python -m controlplane serve`` processes share a database; each runs its own change
watcher (``LISTEN``). A pointer written through one answers long-polls parked on the other within
the 1 s the fleet needs, and a token revoked through one stops working on the other as promptly,
although both cache tokens.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.agent.controlplane_process import ControlPlaneProcess
from tests.controlplane.fleet_parts import BackgroundPoll, Headers
from tests.controlplane.replica_parts import ADMIN, seed, set_stable
from weightship.testing import eventually as poll_until

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.postgres,
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
]


def test_a_pointer_written_through_one_replica_answers_polls_parked_on_another_within_a_second(
    replicas: tuple[ControlPlaneProcess, ControlPlaneProcess], database_url: str
) -> None:
    writer, holder = replicas
    digests = seed(database_url, "llama", ("v1", "v2", "v3"))
    with (
        httpx.Client(base_url=writer.url, timeout=30) as via_writer,
        httpx.Client(base_url=holder.url, timeout=30) as via_holder,
    ):
        assert (
            via_writer.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=ADMIN).status_code
            == 201
        )
        set_stable(via_writer, "v1")
        agent: Headers = ADMIN
        node_id = via_holder.post(
            "/v1/nodes/register", json={"name": "gpu-1", "deployments": ["chat"]}, headers=agent
        ).json()["id"]
        for label in ("v2", "v3"):
            revision = via_holder.get(f"/v1/nodes/{node_id}/desired", headers=agent).json()["revision"]
            poll = BackgroundPoll(holder.url, agent, node_id, revision, wait=30)
            poll_until(lambda: holder.parked() == 1, 30, "the long-poll parking on the second replica")
            set_stable(via_writer, label)
            written = time.monotonic()
            response = poll.join(timeout=30)
            assert response.json()["deployments"][0]["digest"] == digests[label]
            latency = poll.arrived - written
            assert latency < 1.0, f"the other replica answered {latency:.3f}s after the write"


def test_a_token_revoked_through_one_replica_stops_working_on_another_within_a_second(
    replicas: tuple[ControlPlaneProcess, ControlPlaneProcess],
) -> None:
    revoker, other = replicas
    with (
        httpx.Client(base_url=revoker.url, timeout=30) as via_revoker,
        httpx.Client(base_url=other.url, timeout=30) as via_other,
    ):
        minted = via_revoker.post("/v1/tokens", json={"name": "on-call", "role": "operator"}, headers=ADMIN).json()
        headers = {"Authorization": f"Bearer {minted['token']}"}
        assert via_other.get("/v1/nodes", headers=headers).status_code == 200  # now in the other's cache
        assert via_revoker.delete(f"/v1/tokens/{minted['id']}", headers=ADMIN).status_code == 204
        revoked = time.monotonic()
        poll_until(
            lambda: via_other.get("/v1/nodes", headers=headers).status_code == 401,
            10,
            "the revocation to reach the other replica",
        )
        latency = time.monotonic() - revoked
        assert latency < 1.0, f"the revoked token still worked on the other replica {latency:.3f}s later"
