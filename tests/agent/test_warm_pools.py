"""Real agent processes and a real control plane: warm pools and preheats stage versions without serving them.

A node in a deployment's warm pool holds the deployment's stable version verified before it
serves anything; once it is assigned to the deployment (new capacity joining), its switch
downloads nothing. A preheat stages the next version on a serving node, which keeps serving the
current one; the switch then downloads nothing either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from weightship.schemas import NodeHeartbeat, VersionState
from weightship.testing import TEST_CHUNK

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

Start = Callable[..., AgentProcess]


@pytest.fixture
async def start(tmp_path: Path, controlplane: ControlPlaneProcess) -> AsyncIterator[Start]:
    """``start(name, deployments, *extra)``: an agent process against ``controlplane``, stopped at the end."""
    with controlplane.client() as admin:
        token = admin.create_token("staging-agents", "agent").token
    started: list[AgentProcess] = []
    (tmp_path / "agents").mkdir()

    def launch(name: str, deployments: Sequence[str], *extra: str) -> AgentProcess:
        agent = AgentProcess(tmp_path / "agents", name, controlplane.url, token, deployments, extra)
        agent.start()
        started.append(agent)
        return agent

    yield launch
    for agent in started:
        await agent.close()


async def holds_verified(agent: AgentProcess, digest: str, within: float = 60.0) -> NodeHeartbeat:
    """Wait until ``agent`` reports ``digest`` ready (fetched and verified by itself); its report."""

    async def probe() -> NodeHeartbeat | None:
        report = await agent.status()
        return report if any(i.digest == digest and i.state == VersionState.ready for i in report.inventory) else None

    return await eventually(probe, within, f"agent {agent.name} to hold {digest[:19]} verified")


async def test_a_warm_node_joining_the_deployment_switches_with_zero_bytes_fetched(
    controlplane: ControlPlaneProcess, start: Start, make_model: Callable[..., Path]
) -> None:
    with controlplane.client() as admin:
        v1 = admin.publish_directory(make_model("v1", tensors_mb=0.5, seed=1), "m", ["v1"], chunk_size=TEST_CHUNK)
        admin.create_deployment("chat", "m", warm_pool={"cluster": "warm"})
        admin.set_pointer("chat", "v1", expected_epoch=0)

    # New capacity: registered for no deployment, in the warm pool's cluster.
    warm = start("warm-1", [], "--cluster", "warm")
    await warm.ready()
    staged = await holds_verified(warm, v1.version.digest)
    assert staged.deployments == [], "a staged version was served"
    assert staged.counters.bytes_downloaded > 0
    assert (await warm.get("/local/v1/deployments")).json() == []

    # Assigned to the deployment: the same machine, its agent restarted serving ``chat``.
    warm.stop()
    joined = start("warm-1", ["chat"], "--cluster", "warm")
    await joined.ready()
    await joined.serving(v1.version.digest, "chat")
    counters = (await joined.status()).counters
    assert counters.bytes_downloaded == 0, f"the switch fetched {counters.bytes_downloaded} bytes"
    assert sum(t.bytes for t in counters.sources.values()) == 0


async def test_a_preheated_version_is_staged_while_the_old_one_serves_and_the_switch_fetches_nothing(
    controlplane: ControlPlaneProcess, start: Start, make_model: Callable[..., Path]
) -> None:
    with controlplane.client() as admin:
        v1 = admin.publish_directory(make_model("v1", tensors_mb=0.5, seed=1), "m", ["v1"], chunk_size=TEST_CHUNK)
        v2 = admin.publish_directory(make_model("v2", tensors_mb=0.5, seed=2), "m", ["v2"], chunk_size=TEST_CHUNK)
        admin.create_deployment("chat", "m")
        pointer = admin.set_pointer("chat", "v1", expected_epoch=0)
    node = start("gpu-1", ["chat"], "--rack", "r1", "--no-prefetch")
    other = start("gpu-2", ["chat"], "--rack", "r2", "--no-prefetch")
    for agent in (node, other):
        await agent.ready()
        await agent.serving(v1.version.digest, "chat")

    with controlplane.client() as admin:
        preheat = admin.preheat("chat", "v2", {"rack": "r1"})
    report = await holds_verified(node, v2.version.digest)
    assert [d.digest for d in report.deployments] == [v1.version.digest], "the preheat switched the node"
    assert (await node.deployment("chat")) is not None
    assert not any(i.digest == v2.version.digest for i in (await other.status()).inventory)

    async def progress_done() -> bool | None:
        with controlplane.client() as admin:
            listed = admin.list_preheats("chat")
        return True if [(p.id, p.nodes_matched, p.nodes_staged) for p in listed] == [(preheat.id, 1, 1)] else None

    await eventually(progress_done, 30, "the preheat's progress to show the node staged")
    fetched = report.counters.bytes_downloaded
    with controlplane.client() as admin:
        admin.set_pointer("chat", "v2", expected_epoch=pointer.epoch)
    await node.serving(v2.version.digest, "chat")
    assert (await node.status()).counters.bytes_downloaded == fetched, "the switch to a preheated version fetched"


async def test_a_preheated_version_is_not_evicted_for_room_while_the_preheat_stands(
    controlplane: ControlPlaneProcess, start: Start, make_model: Callable[..., Path]
) -> None:
    with controlplane.client() as admin:
        q = [
            admin.publish_directory(
                make_model(f"q{i}", tensors_mb=0.5, seed=10 + i), "m", [f"q{i}"], chunk_size=TEST_CHUNK
            ).version.digest
            for i in range(4)
        ]
        admin.create_deployment("chat", "m")
        epoch = admin.set_pointer("chat", "q1", expected_epoch=0).epoch
    # room for about three and a half versions of ~540 KiB each
    node = start("gpu-1", ["chat"], "--quota", str(int(3.5 * 540 * 1024)), "--no-prefetch")
    await node.ready()
    await node.serving(q[1], "chat")
    with controlplane.client() as admin:
        admin.preheat("chat", "q0")
    await holds_verified(node, q[0])
    for label, digest in (("q2", q[2]), ("q3", q[3])):
        with controlplane.client() as admin:
            epoch = admin.set_pointer("chat", label, expected_epoch=epoch).epoch
        await node.serving(digest, "chat")

    held = {i.digest for i in (await node.status()).inventory}
    assert held == {q[0], q[2], q[3]}, "the preheated version was evicted, or the unreferenced one kept"
    assert f"retention.evicted digest={q[1]}" in node.log()
