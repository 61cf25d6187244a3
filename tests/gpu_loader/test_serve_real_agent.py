"""``weightship-serve`` against a real agent and a real control plane: serve, hot-swap, roll back.

Every part is its own process, as on a GPU node: the control plane (SQLite, local-directory
origin), ``weightship-agent`` fetching from it, and ``weightship-serve`` asking that agent's local
API what to serve. The operator's moves go through the REST API. Nothing is faked: the versions
the server loads are the ones the agent fetched and verified, and the server's validation reports
reach the agent (which forwards them in its heartbeat).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_loader.modelgen import generate
from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.gpu_loader.server_process import PROMPT, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def served_by(server: ServerProcess) -> str | None:
    """The digest a generate request is answered with right now (``None`` while not ready)."""
    response = server.client.post("/v1/generate", json=PROMPT)
    return str(response.json()["digest"]) if response.status_code == 200 else None


async def test_serve_follows_a_real_agent_through_a_pointer_change_and_a_rollback(tmp_path: Path) -> None:
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agent: AgentProcess | None = None
    server: ServerProcess | None = None
    try:
        await cp.ready()
        generate(tmp_path / "m1", size_mb=2, seed=11)
        generate(tmp_path / "m2", size_mb=2, seed=11, variant=1)
        with cp.client() as admin:
            v1 = admin.publish_directory(tmp_path / "m1", "tiny", ["v1"]).version.digest
            v2 = admin.publish_directory(tmp_path / "m2", "tiny", ["v2"]).version.digest
            token = admin.create_token("serve-test", "agent").token
            epoch = admin.create_deployment("chat", "tiny").epoch
            epoch = admin.set_pointer("chat", "v1", expected_epoch=epoch).epoch

        agent = AgentProcess(tmp_path / "agents", "gpu-node-1", cp.url, token, ["chat"])
        agent.data_dir.parent.mkdir(parents=True)
        agent.start()
        await agent.ready()
        await agent.serving(v1)

        server = ServerProcess(["--agent", agent.url, "--deployment", "chat", "--poll-seconds", "5"], tmp_path)
        assert await eventually(lambda: server.ready_digest() == v1 and served_by(server), 120, "v1 served") == v1

        with cp.client() as admin:
            epoch = admin.set_pointer("chat", "v2", expected_epoch=epoch).epoch
        await eventually(lambda: served_by(server) == v2, 120, "the hot swap to v2")
        downloaded = (await agent.status()).counters.bytes_downloaded

        with cp.client() as admin:
            admin.rollback("chat", reason="serve test")
        await eventually(lambda: served_by(server) == v1, 120, "the swap back to v1 after the rollback")
        assert (await agent.status()).counters.bytes_downloaded == downloaded, "a rollback downloads nothing"
        assert served_by(server) == v1
        assert server.metric("weightship_serve_swaps_total") == 2.0

        for digest in (v1, v2):  # the server's validation reports reached the agent
            assert f"validation.received deployment=chat digest={digest} passed=True" in agent.log()
    finally:
        if server is not None:
            server.stop()
        if agent is not None:
            await agent.close()
        cp.stop()
