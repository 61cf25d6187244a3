"""Two deployments sharing a version store it once and download it once."""

from __future__ import annotations

import os

import pytest

from tests.agent.agent_processes import Spawn
from tests.agent.fleet import Fleet
from weightship.digests import hex_of
from weightship.manifest import Manifest
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_two_deployments_sharing_a_version_store_it_once(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1 = versions["v1"]
    both = [deployment, f"{deployment}-canary"]
    for name in both:
        fleet.point(name, model, "v1")
    agent = spawn("node-s", deployments=both)
    await agent.ready()
    first = await agent.serving(v1.digest, both[0])
    second = await agent.serving(v1.digest, both[1])
    assert first.path == second.path
    assert os.listdir(agent.data_dir / "versions") == [hex_of(v1.digest)]
    links = {os.readlink(agent.data_dir / "deployments" / d / "current") for d in both}
    assert links == {f"../../versions/{hex_of(v1.digest)}"}
    counters = (await agent.status()).counters
    assert counters.bytes_downloaded == v1.total_size
    starts = [(s.blob, s.start) for s in proxy.served]
    assert len(starts) == len(set(starts)), "a chunk was downloaded twice"
    assert proxy.bytes_served() == v1.total_size
