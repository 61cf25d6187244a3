"""Control plane down: agents keep serving from disk, back off, and reconnect when it returns."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.agent.fleet import Fleet
from weightship.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def retry_delays(log: str, call: str) -> list[float]:
    """The ``retry_in`` of each ``controlplane.unreachable`` line for ``call``."""
    return [float(m) for m in re.findall(rf"controlplane\.unreachable call={call} .*?retry_in=([0-9.]+)", log)]


async def test_agent_keeps_serving_and_reconnects_with_backoff_when_the_control_plane_is_down(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    fleet.point(deployment, model, "v1")
    agent = spawn("node-d")
    await agent.ready()
    await agent.serving(v1.digest)

    fleet.cp.kill()  # the control plane process dies, long-polls and all
    delays = await eventually(
        lambda: d if len(d := retry_delays(agent.log(), "desired")) >= 5 else None, 30, "five reconnect attempts"
    )
    # Exponential with ±20% jitter from 0.05 s, capped at 1 s (the test's --backoff-max).
    assert delays[3] > delays[0] * 3, f"backoff does not grow: {delays}"
    assert max(retry_delays(agent.log(), "desired")) <= 1.0
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.ready) == (v1.digest, True), "the node must keep serving v1"

    # A restart while the control plane is still down serves v1 from disk straight away.
    agent.stop()
    agent.start()
    await agent.ready()
    view = await agent.deployment()
    assert view is not None
    assert view.digest == v1.digest
    assert view.ready
    assert view.epoch == 1

    # The same control plane comes back on the same port and database; the agent finds it.
    fleet.cp.start()
    await fleet.cp.ready()
    fleet.point(deployment, model, "v2")
    await agent.serving(v2.digest, within=30)
    assert "controlplane.reconnected" in agent.log() or "controlplane.registered" in agent.log()

    def reported() -> bool:
        node = fleet.node("node-d")
        return bool(node and [(s.digest, s.epoch) for s in node.serving] == [(v2.digest, 2)] and not node.stale)

    await eventually(reported, 10, "a heartbeat after the outage reporting v2 at epoch 2")


async def test_a_stopping_control_plane_answers_parked_long_polls_and_exits_at_once(
    tmp_path: Path, controlplane: ControlPlaneProcess, model: str
) -> None:
    with controlplane.client() as admin:
        token = admin.create_token("poller", "agent").token
    # Polls that would park for a minute: a stop that waited for them would take that long.
    agent = AgentProcess(tmp_path, "poller", controlplane.url, token, [model], ["--poll-wait", "60"])
    agent.start()
    try:
        await agent.ready()
        await eventually(lambda: controlplane.parked() >= 1 or None, 30, "the agent's long-poll to park")
        began = time.monotonic()
        controlplane.stop()
        took = time.monotonic() - began
        assert took < 10, f"the control plane took {took:.1f} s to stop with a parked poll"
        # The answered poll is asked again, finds nobody, and the agent backs off and keeps trying.
        await eventually(lambda: "controlplane.unreachable call=desired" in agent.log(), 30, "the agent to ask again")
    finally:
        await agent.close()

