"""Versions asked for by digest: the init container's waiter and the local API's version routes, on a real agent.

The control plane and the agent are processes; the agent is started with no ``--deployment``, as
the chart's default is: it follows what the pods on its node ask for. The waiter is run as the
init container runs it (``python -m controlplane.k8s.waiter``, standard library only).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_loader.modelgen import generate
from tests.agent.agent_processes import REPO, AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from weightship.schemas import LocalVersion, LocalVersionState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@dataclass
class Node:
    """A control plane, an agent following nothing yet, and deployment ``chat`` at v1 (v2 published too)."""

    cp: ControlPlaneProcess
    agent: AgentProcess
    v1: str
    v2: str
    epoch: int


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agent: AgentProcess | None = None
    try:
        await cp.ready()
        generate(tmp_path / "m1", size_mb=1, seed=11)
        generate(tmp_path / "m2", size_mb=1, seed=11, variant=1)
        with cp.client() as admin:
            v1 = admin.publish_directory(tmp_path / "m1", "tiny", ["v1"]).version.digest
            v2 = admin.publish_directory(tmp_path / "m2", "tiny", ["v2"]).version.digest
            token = admin.create_token("waiter", "agent").token
            epoch = admin.create_deployment("chat", "tiny").epoch
            epoch = admin.set_pointer("chat", "v1", expected_epoch=epoch).epoch
        agent = AgentProcess(tmp_path / "agents", "gpu-node-1", cp.url, token, [])
        agent.data_dir.parent.mkdir(parents=True)
        agent.start()
        await agent.ready()
        yield Node(cp, agent, v1, v2, epoch)
    finally:
        if agent is not None:
            await agent.close()
        cp.stop()


def waiter(agent: AgentProcess, digest: str, deadline: float) -> subprocess.CompletedProcess[str]:
    """Run the init container's waiter to its end."""
    env = {
        **os.environ,
        "WEIGHTSHIP_DIGEST": digest,
        "WEIGHTSHIP_DEPLOYMENT": "chat",
        "WEIGHTSHIP_AGENT_URL": agent.url,
        "WEIGHTSHIP_WAIT_INTERVAL": "1",
        "WEIGHTSHIP_WAIT_DEADLINE": str(deadline),
    }
    argv = [sys.executable, "-m", "controlplane.k8s.waiter"]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)


async def test_the_waiter_gives_up_at_its_deadline_naming_what_it_waited_for(node: Node) -> None:
    # chat's pointer names v1 only: the node may not fetch v2, and says so.
    done = waiter(node.agent, node.v2, deadline=4)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"waiter.gave_up digest={node.v2} deployment=chat agent={node.agent.url} waited=4s state=unknown"
    ), done.stdout
    assert node.v1 in last  # the reason: what the pointer names instead


async def test_the_waiter_makes_the_agent_stage_the_version_and_returns_once_it_is_verified(node: Node) -> None:
    with node.cp.client() as admin:
        admin.set_pointer("chat", "v1", canary="v2", canary_share=0.0, expected_epoch=node.epoch)
    # The agent follows no deployment until the waiter names one; then it stages v2, which nothing serves.
    done = waiter(node.agent, node.v2, deadline=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"waiter.ready digest={node.v2}" in done.stdout
    view = LocalVersion.model_validate_json(
        (await node.agent.get(f"/local/v1/versions/{node.v2}", deployment="chat")).content
    )
    assert view.state == LocalVersionState.ready
    assert view.path is not None
    assert await asyncio.to_thread(Path(view.path).is_dir)
    assert view.bytes_present == view.bytes_total > 0


async def test_a_malformed_ask_is_a_problem_naming_what_is_wrong(node: Node) -> None:
    bad = await node.agent.get("/local/v1/versions/v2", deployment="chat")
    assert bad.status_code == 400
    assert "sha256:<64 hex digits>" in bad.json()["detail"]
    bad = await node.agent.get(f"/local/v1/versions/{node.v2}", deployment="Not A Name")
    assert bad.status_code == 400
    lease = await node.agent._http.put(
        node.agent.url + "/local/v1/leases/server-1", json={"deployment": "chat", "digest": node.v1, "seconds": 0}
    )
    assert lease.status_code == 422

    async def pinned_without_a_pointer() -> LocalVersion | None:
        answer = await node.agent.get(f"/local/v1/versions/{node.v1}")
        view = LocalVersion.model_validate_json(answer.content)
        return view if view.state == LocalVersionState.unknown else None

    view = await eventually(pinned_without_a_pointer, 30, "an ask without a deployment to be answered")
    assert "?deployment=NAME" in view.reason
