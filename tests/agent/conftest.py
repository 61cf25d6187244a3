"""Fixtures for agent tests: fake origin and control plane in-process, agents as real processes.

- ``origin``: an ``Origin`` blob server; ``origin.publish(dir, model)`` returns the manifest.
- ``fake_cp``: a ``FakeControlPlane`` whose blob URLs point at ``origin``.
- ``spawn``: ``spawn(name, deployments=("chat",), extra=())`` starts an agent process against
  ``fake_cp``; every agent is stopped at the end of the test.
- ``versions``: three small distinct models published to ``origin`` (``v1``, ``v2``, ``v3``).
- ``controlplane``: the real control plane as a process (``ControlPlaneProcess``), ready.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.agent.fleet_fakes import AGENT_TOKEN, FakeControlPlane, Origin
from weightship.manifest import Manifest


@pytest.fixture
async def origin(tmp_path: Path) -> AsyncIterator[Origin]:
    """A blob origin with range requests on a loopback port."""
    server = Origin(tmp_path / "origin")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def fake_cp(origin: Origin) -> AsyncIterator[FakeControlPlane]:
    """A fake control plane handing out blob URLs on ``origin``."""
    cp = FakeControlPlane(origin)
    await cp.start()
    yield cp
    await cp.stop()


@pytest.fixture
async def spawn(tmp_path: Path, fake_cp: FakeControlPlane) -> AsyncIterator[Spawn]:
    """Start agent processes against ``fake_cp``; all are stopped at the end."""
    started: list[AgentProcess] = []

    def start(name: str, deployments: Sequence[str] = ("chat",), extra: Sequence[str] = ()) -> AgentProcess:
        agent = AgentProcess(tmp_path / "agents", name, fake_cp.url, AGENT_TOKEN, deployments, extra)
        agent.data_dir.parent.mkdir(parents=True, exist_ok=True)
        agent.start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        await agent.close()


@pytest.fixture
def versions(make_model: Callable[..., Path], origin: Origin) -> dict[str, Manifest]:
    """Three distinct versions of model ``m`` (about 0.5 MiB each, 64 KiB chunks) in ``origin``."""
    return {
        label: origin.publish(make_model(f"model-{label}", tensors_mb=0.5, seed=seed), "m")
        for seed, label in enumerate(("v1", "v2", "v3"), start=1)
    }


@pytest.fixture
async def controlplane(tmp_path: Path) -> AsyncIterator[ControlPlaneProcess]:
    """The real control plane as a process (SQLite, local-directory origin), ready."""
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    try:
        await cp.ready()
        yield cp
    finally:
        cp.stop()
