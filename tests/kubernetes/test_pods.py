"""The model-server pods the operator creates, as the chart configures it: mounts, the wait, the image.

The operator's configuration comes from the environment the chart renders (real Helm), so these
tests join the two: the ReplicaSet the operator would create is checked against the Kubernetes
schema (strict), and its init container (``python -m controlplane.k8s.waiter``, run as a real
process) is shown to wait on the agent's socket until the version is verified.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from controlplane.k8s.operator import OperatorConfig
from controlplane.k8s.replicasets import build_replicaset
from controlplane.k8s.rollout import parse_rollout
from tests.kubernetes.chart_parts import REQUIRED, find, merged, objects, validate
from tests.kubernetes.conftest import REPO
from tests.kubernetes.rollout_parts import rollout
from weightship.schemas import NodeHeartbeat, VersionInventory, VersionState
from weightship.testing import eventually_async

DIGEST = "sha256:" + "ab" * 32


def operator_env(values: dict[str, Any]) -> dict[str, str]:
    """The plain environment variables the chart gives the operator container."""
    deployment = find(objects(values), "Deployment", "-operator")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def pod_of(config: OperatorConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """The ReplicaSet the operator configured by ``config`` builds for ``spec``, validated strictly."""
    replicaset = build_replicaset(
        rollout="chat", namespace="models", uid="0b7e1c1e-0000-4000-8000-000000000001", spec=parse_rollout(spec),
        digest=DIGEST, role="canary", replicas=1, wait_image=config.wait_image, paths=config.agent_paths,
    )  # fmt: skip
    validate(replicaset)
    pod: dict[str, Any] = replicaset["spec"]["template"]["spec"]
    return pod


@pytest.mark.timeout(60)
def test_pods_mount_the_agents_versions_read_only_and_its_socket_where_the_chart_puts_them() -> None:
    values = merged(REQUIRED, {"agent": {"hostDataDir": "/mnt/nvme/weightship/", "socketDir": "/run/ws"}})
    env = operator_env(values)
    config = OperatorConfig.from_env(env)
    pod = pod_of(config, rollout("v2", [])["spec"])

    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert sorted(volumes.values()) == ["/mnt/nvme/weightship/versions", "/run/ws"]  # never state/ (node token)
    (server,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts["/mnt/nvme/weightship/versions"]["readOnly"] is True
    assert "/run/ws" in mounts
    (waiter,) = pod["initContainers"]
    assert waiter["image"] == find(objects(values), "Deployment", "-operator")["spec"]["template"]["spec"][
        "containers"
    ][0]["image"]  # the operator's own image: it holds the waiter
    assert {e["name"]: e.get("value") for e in waiter["env"]}["WEIGHTSHIP_AGENT_URL"] == "unix:/run/ws/agent.sock"
    assert [m["mountPath"] for m in waiter["volumeMounts"]] == ["/run/ws"]


@pytest.mark.timeout(60)
def test_a_template_that_mounts_the_paths_itself_keeps_its_mounts_and_a_port_uses_the_node_network() -> None:
    spec = rollout("v2", [])["spec"]
    spec["template"]["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "weights", "mountPath": "/var/lib/weightship/versions", "readOnly": True}
    ]
    spec["template"]["spec"]["volumes"] = [{"name": "weights", "hostPath": {"path": "/var/lib/weightship/versions"}}]
    spec["agent"] = {"port": 7070}
    pod = pod_of(OperatorConfig.from_env({}), spec)
    (server,) = pod["containers"]
    assert [m["name"] for m in server["volumeMounts"] if m["mountPath"] == "/var/lib/weightship/versions"] == [
        "weights"
    ]
    env = {e["name"]: e for e in pod["initContainers"][0]["env"]}
    assert env["WEIGHTSHIP_AGENT_URL"]["value"] == "http://$(HOST_IP):7070"
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"


class AgentSocket:
    """An HTTP server on a Unix socket answering ``GET /local/v1/status`` with a real ``NodeHeartbeat``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state: str | None = None  # None: the version is not on the node yet
        self.asked = 0

    async def status(self, _: web.Request) -> web.Response:
        self.asked += 1
        inventory = [] if self.state is None else [
            VersionInventory(digest=DIGEST, state=VersionState(self.state), bytes_total=10, bytes_present=10)
        ]  # fmt: skip
        return web.json_response(NodeHeartbeat(inventory=inventory).model_dump(mode="json"))


@pytest_asyncio.fixture
async def agent_socket() -> AsyncIterator[AgentSocket]:
    """The socket in a short temporary directory (Unix socket paths are limited to ~100 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="ws-sock-"))
    agent = AgentSocket(directory / "agent.sock")
    app = web.Application()
    app.router.add_get("/local/v1/status", agent.status)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(agent.path)).start()
    yield agent
    await runner.cleanup()
    shutil.rmtree(directory, ignore_errors=True)


def start_waiter(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m controlplane.k8s.waiter`` as the init container runs it, its output in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "controlplane.k8s.waiter"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )


@pytest.mark.timeout(60)
async def test_the_init_container_waits_on_the_agents_socket_until_the_version_is_verified(
    agent_socket: AgentSocket, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "WEIGHTSHIP_DIGEST": DIGEST,
        "WEIGHTSHIP_AGENT_URL": f"unix:{agent_socket.path}",
        "WEIGHTSHIP_WAIT_INTERVAL": "0.05",
    }
    log = tmp_path / "waiter.log"
    waiter = start_waiter(env, log)
    try:
        await eventually_async(lambda: agent_socket.asked >= 3, 30, "the waiter to ask the agent")
        agent_socket.state = "fetching"
        await eventually_async(lambda: "state=fetching" in log.read_text(), 30, "the waiter to see the fetch")
        assert waiter.poll() is None  # absent, then fetching: still waiting
        agent_socket.state = "ready"
        await eventually_async(lambda: waiter.poll() is not None, 30, "the waiter to exit")
        assert waiter.returncode == 0, log.read_text()
        assert f"waiter.ready digest={DIGEST}" in log.read_text()
    finally:
        if waiter.poll() is None:
            waiter.kill()
        await asyncio.to_thread(waiter.wait, 10)
