"""Fixtures for agent tests: the real control plane and agents as processes, faults from outside.

- ``fleet`` (one per test module): a ``Fleet``: the control plane as a process (SQLite,
  local-directory origin) whose signed blob URLs go through a ``FaultProxy``; publish, point,
  roll back and read nodes over the real REST API.
- ``proxy``: the module's ``FaultProxy``, reset for this test (no faults, nothing recorded).
- ``model`` / ``deployment``: names of this test's own model and deployment on the shared fleet.
- ``spawn``: ``spawn(name, deployments=None, extra=())`` starts an agent process against the
  fleet (on this test's deployment unless told otherwise); every agent is stopped at the end.
- ``versions``: three small distinct versions of ``model`` (``v1``, ``v2``, ``v3``), published.
- ``controlplane``: a control plane of the test's own, without a proxy, ready.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.agent.fleet import Fleet
from tests.agent.peers import start_cache
from weightship.manifest import Manifest
from weightship.testing import FaultProxy


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The control plane (a process) behind its fault proxy, shared by the tests of one module."""
    world = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        world.start()
        yield world
    finally:
        world.close()


@pytest.fixture
def proxy(fleet: Fleet) -> Iterator[FaultProxy]:
    """The fleet's fault proxy, with no faults and nothing recorded; anything held is released after."""
    fleet.proxy.reset()
    yield fleet.proxy
    fleet.proxy.reset()


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """This test's model name (its function name), distinct from every other test's."""
    return str(request.node.originalname).removeprefix("test_").replace("_", "-")[:100]


@pytest.fixture
def deployment(model: str) -> str:
    """This test's deployment name."""
    return model


@pytest.fixture
async def spawn(tmp_path: Path, fleet: Fleet, proxy: FaultProxy, deployment: str) -> AsyncIterator[Spawn]:
    """Start agent processes against ``fleet``; all are stopped at the end."""
    started: list[AgentProcess] = []

    def start(name: str, deployments: Sequence[str] | None = None, extra: Sequence[str] = ()) -> AgentProcess:
        agent = AgentProcess(
            tmp_path / "agents", name, fleet.cp.url, fleet.agent_token, deployments or [deployment], extra
        )
        agent.data_dir.parent.mkdir(parents=True, exist_ok=True)
        agent.start()
        started.append(agent)
        return agent

    yield start
    proxy.release()
    for agent in started:
        await agent.close()


@pytest.fixture
def versions(fleet: Fleet, model: str, make_model: Callable[..., Path]) -> dict[str, Manifest]:
    """Three distinct versions of ``model`` (about 0.5 MiB each, 64 KiB chunks), published."""
    return {
        label: fleet.publish(make_model(f"model-{label}", tensors_mb=0.5, seed=seed), model, label)
        for seed, label in enumerate(("v1", "v2", "v3"), start=1)
    }


@pytest.fixture
async def controlplane(tmp_path: Path) -> AsyncIterator[ControlPlaneProcess]:
    """A control plane of this test's own (SQLite, local-directory origin), ready."""
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    try:
        await cp.ready()
        yield cp
    finally:
        cp.stop()


@pytest.fixture
async def cluster_cache(tmp_path: Path, fleet: Fleet, model: str) -> AsyncIterator[AgentProcess]:
    """A cluster cache (which runs the tracker) on a free port, enrolled with the caches' token; stopped after."""
    process = start_cache(tmp_path, fleet, f"{model[:50]}-cache")
    await process.ready()
    await eventually(lambda: "tickets.keys_read" in process.log(), 30, "the cache to read the ticket keys")
    yield process
    await process.close()
