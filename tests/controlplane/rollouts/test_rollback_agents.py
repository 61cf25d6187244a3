"""A failed analysis rolls real agents back to the stable version with zero bytes downloaded.

A real control plane (its own rollout driver ticking) and four real agent processes serving v1.
The rollout prefetches v2 on every node, moves half of them (the hashed canary subset) to v2,
then its analysis fails (a real webhook answers a bad value): the driver flips the pointer back to
v1 at a new epoch, the canary nodes switch to the v1 already on their disk, and no agent downloads
a byte for it. The pointer history names the rollout and why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.fleet import in_canary
from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.controlplane.rollouts.fleet_driving import Hook, metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

AGENTS = 4
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NODES = [f"node-{i}" for i in range(AGENTS)]


def split_deployment_name() -> str:
    """A deployment name whose 50 % canary subset of NODES holds some nodes, not all."""
    for i in range(100):
        name = f"chat-{i}"
        if 0 < sum(in_canary(name, node, 0.5) for node in NODES) < AGENTS:
            return name
    raise AssertionError("no deployment name splits the nodes")


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.close()


async def test_a_failed_analysis_rolls_the_canary_nodes_back_with_zero_bytes_downloaded(
    tmp_path: Path, make_model: Callable[..., Path], hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_ROLLOUT_TICK_SECONDS", "0.3")
    controlplane = ControlPlaneProcess(tmp_path / "controlplane")
    controlplane.start()
    agents: list[AgentProcess] = []
    deployment = split_deployment_name()
    try:
        await controlplane.ready()
        with controlplane.client() as admin:
            v1 = admin.publish_directory(make_model("v1", tensors_mb=0.5, seed=1), "m", ["v1"], chunk_size=65536)
            v2 = admin.publish_directory(make_model("v2", tensors_mb=0.5, seed=2), "m", ["v2"], chunk_size=65536)
            token = admin.create_token("fleet-agents", "agent").token
            admin.create_deployment(deployment, "m")
            admin.set_pointer(deployment, "v1", expected_epoch=0)
        (tmp_path / "fleet").mkdir()
        agents = [AgentProcess(tmp_path / "fleet", n, controlplane.url, token, [deployment]) for n in NODES]
        for agent in agents:
            agent.start()
        for agent in agents:
            await agent.ready()
        await asyncio.gather(*(a.serving(v1.version.digest, deployment, within=120) for a in agents))

        hook.answers = {"quality": [0.9]}  # above 0.1: Failed
        spec = {
            "version": "v2",
            "steps": [
                {"prefetch": {"percent": 100}},
                {"setWeight": 50},
                {"analysis": {"metrics": [metric(hook, "quality", initialDelay="3s")]}},
            ],
        }
        http = httpx.AsyncClient(base_url=controlplane.url, headers=ADMIN, timeout=30)
        created = await http.post(f"/v1/deployments/{deployment}/rollouts", json={"spec": spec})
        assert created.status_code == 201, created.text
        rollout_id = created.json()["id"]
        url = f"/v1/deployments/{deployment}/rollouts/{rollout_id}"

        async def in_analysis() -> bool:
            return bool((await http.get(url)).json()["step_index"] == 2)

        await eventually(in_analysis, 90, "the canary serving and the analysis started")
        canaries = [a for a in agents if in_canary(deployment, a.name, 0.5)]
        for agent in canaries:
            view = await agent.deployment(deployment)
            assert view is not None
            assert view.digest == v2.version.digest
        before = {a.name: (await a.status()).counters.bytes_downloaded for a in agents}

        async def degraded() -> bool:
            return bool((await http.get(url)).json()["phase"] == "Degraded")

        await eventually(degraded, 30, "the analysis to fail")
        await asyncio.gather(*(a.serving(v1.version.digest, deployment, within=60) for a in agents))

        after = {a.name: (await a.status()).counters.bytes_downloaded for a in agents}
        assert after == before, "the rollback must not download anything"
        rollout = (await http.get(url)).json()
        assert "AnalysisFailed" in rollout["message"]
        history = (await http.get(f"/v1/deployments/{deployment}/history")).json()
        assert history[0]["actor"] == f"rollout:{rollout_id}"
        assert history[0]["action"] == "abort"
        assert history[0]["to_stable"] == v1.version.digest
        assert "AnalysisFailed" in history[0]["reason"]
        await http.aclose()
    finally:
        for agent in agents:
            await agent.close()
        controlplane.stop()
