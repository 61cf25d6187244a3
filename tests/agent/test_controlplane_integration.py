"""One agent against the real control plane: publish, fetch on signed URLs, switch, status, outage and return."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from weightship.digests import hex_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_agent_serves_what_the_real_control_plane_points_at_and_survives_its_restart(
    tmp_path: Path, controlplane: ControlPlaneProcess, make_model: Callable[..., Path]
) -> None:
    with controlplane.client() as admin:
        v1 = admin.publish_directory(make_model("v1", tensors_mb=1.0, seed=1, shards=2), "m", ["v1"], chunk_size=65536)
        v2 = admin.publish_directory(make_model("v2", tensors_mb=1.0, seed=2, shards=2), "m", ["v2"], chunk_size=65536)
        token = admin.create_token("node-agent", "agent").token
        admin.create_deployment("chat", "m")
        pointer = admin.set_pointer("chat", "v1", expected_epoch=admin.get_deployment("chat").epoch)
    agent = AgentProcess(
        tmp_path, "node-i", controlplane.url, token, ["chat"], ["--region", "eu", "--gpu-type", "h200"]
    )
    agent.start()
    try:
        await agent.ready()
        view = await agent.serving(v1.version.digest)
        for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json"):
            assert (Path(view.path or "") / name).is_file()

        def status_ready() -> bool:
            with controlplane.client() as admin:
                status = admin.deployment_status("chat")
            by_digest = {v.digest: v for v in status.versions}
            row = by_digest.get(v1.version.digest)
            return bool(row and row.nodes_ready == 1 and row.nodes_serving == 1 and not status.lagging_nodes)

        await eventually(status_ready, 15, "`weightship status chat` to show the node ready and serving v1")
        with controlplane.client() as admin:
            (node,) = admin.list_nodes("chat")
        assert (node.name, node.labels.region, node.labels.gpu_type) == ("node-i", "eu", "h200")

        controlplane.stop()
        await eventually(lambda: "controlplane.unreachable" in agent.log(), 20, "the agent to notice the outage")
        during = await agent.deployment()
        assert during is not None
        assert (during.digest, during.ready) == (v1.version.digest, True), "the node keeps serving during the outage"

        controlplane.start()
        await controlplane.ready()
        with controlplane.client() as admin:
            admin.set_pointer("chat", "v2", expected_epoch=pointer.epoch)
        await agent.serving(v2.version.digest, within=30)
        assert (agent.data_dir / "versions" / hex_of(v1.version.digest)).is_dir(), "v1 stays for a rollback"

        def counted() -> bool:
            with controlplane.client() as admin:
                (node,) = admin.list_nodes("chat")
            shared = v2.bytes_total - v2.bytes_uploaded  # config/index identical to v1: stored and fetched once
            return node.counters.bytes_downloaded == v1.bytes_total + v2.bytes_total - shared

        await eventually(counted, 15, "the node's byte counters at the control plane")
    finally:
        await agent.close()
