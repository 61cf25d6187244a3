"""16 agents against the real control plane: ``weightship rollback`` flips all back with zero bytes downloaded."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from weightship.schemas import LocalDeployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

AGENTS = 16


async def test_rollback_flips_16_agents_to_the_previous_stable_with_zero_bytes_downloaded(
    tmp_path: Path, controlplane: ControlPlaneProcess, make_model: Callable[..., Path]
) -> None:
    with controlplane.client() as admin:
        v1 = admin.publish_directory(
            make_model("v1", tensors_mb=0.5, seed=1), "m", ["v1"], chunk_size=64 * 1024
        ).version
        v2 = admin.publish_directory(
            make_model("v2", tensors_mb=0.5, seed=2), "m", ["v2"], chunk_size=64 * 1024
        ).version
        agent_token = admin.create_token("fleet-agents", "agent").token
        admin.create_deployment("chat", "m")
        pointer = admin.set_pointer("chat", "v1", expected_epoch=admin.get_deployment("chat").epoch)

    agents = [
        AgentProcess(
            tmp_path / "fleet", f"node-{i:02d}", controlplane.url, agent_token, ["chat"], ["--concurrency", "2"]
        )
        for i in range(AGENTS)
    ]
    (tmp_path / "fleet").mkdir()
    try:
        for agent in agents:
            agent.start()
        for agent in agents:
            await agent.ready()
        await asyncio.gather(*(a.serving(v1.digest, within=120) for a in agents))
        with controlplane.client() as admin:
            pointer = admin.set_pointer("chat", "v2", expected_epoch=pointer.epoch)
        await asyncio.gather(*(a.serving(v2.digest, within=120) for a in agents))
        before = {a.name: (await a.status()).counters for a in agents}
        assert all(c.bytes_downloaded > 0 for c in before.values())

        # Every agent long-polls its local API for the next switch, as a model server would.
        switched_at: dict[str, float] = {}
        switched_wall: dict[str, float] = {}

        async def watch(agent: AgentProcess) -> LocalDeployment:
            response = await agent.get("/local/v1/deployments/chat/wait", after_epoch=pointer.epoch, timeout=30)
            switched_at[agent.name] = time.monotonic()
            switched_wall[agent.name] = time.time()
            return LocalDeployment.model_validate_json(response.content)

        watchers = [asyncio.create_task(watch(a)) for a in agents]
        env = {**os.environ, "WEIGHTSHIP_URL": controlplane.url, "WEIGHTSHIP_TOKEN": ADMIN_TOKEN}
        started = time.monotonic()
        cli = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "weightship"),
            "rollback",
            "chat",
            "--reason",
            "agent test",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        output, _ = await cli.communicate()
        cli_done = time.monotonic()
        assert cli.returncode == 0, output.decode()
        views = await asyncio.gather(*watchers)
        all_switched = max(switched_at.values()) - started

        assert {(v.digest, v.ready) for v in views} == {(v1.digest, True)}
        assert {v.epoch for v in views} == {pointer.epoch + 1}
        after = {a.name: (await a.status()).counters for a in agents}
        downloaded = {n: after[n].bytes_downloaded - before[n].bytes_downloaded for n in after}
        assert downloaded == dict.fromkeys(downloaded, 0), "a rollback must not download anything"
        for agent in agents:
            link = agent.data_dir / "deployments" / "chat" / "current"
            assert os.readlink(link).endswith(v1.digest.removeprefix("sha256:"))

        # The control plane hears it too.
        def fleet_serves_v1() -> bool:
            with controlplane.client() as admin:
                nodes = admin.list_nodes("chat")
            return len(nodes) == AGENTS and all(
                [(s.digest, s.epoch) for s in n.serving] == [(v1.digest, pointer.epoch + 1)] for n in nodes
            )

        await eventually(fleet_serves_v1, 15, "every node reporting v1 to the control plane")
        with controlplane.client() as admin:
            committed = admin.history("chat", limit=1)[0]
        assert committed.action == "rollback"
        print(
            f"\nrollback: {AGENTS} agents all switched {all_switched:.3f}s after `weightship rollback` started "
            f"({max(switched_wall.values()) - committed.at.timestamp():.3f}s after the control plane committed the "
            f"rollback; the CLI process took {cli_done - started:.3f}s); "
            f"bytes downloaded during rollback: {sum(downloaded.values())}"
        )
    finally:
        for agent in agents:
            await agent.close()
