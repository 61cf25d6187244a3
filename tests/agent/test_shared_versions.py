"""Two deployments sharing a version store it once and download it once."""

from __future__ import annotations

import os

import pytest

from tests.agent.agent_processes import Spawn
from tests.agent.fleet_fakes import FakeControlPlane, Origin
from weightship.digests import hex_of
from weightship.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_two_deployments_sharing_a_version_store_it_once(
    spawn: Spawn, fake_cp: FakeControlPlane, origin: Origin, versions: dict[str, Manifest]
) -> None:
    v1 = versions["v1"]
    await fake_cp.set_pointer("chat", "m", v1.digest)
    await fake_cp.set_pointer("chat-canary", "m", v1.digest)
    agent = spawn("node-s", deployments=["chat", "chat-canary"])
    await agent.ready()
    chat = await agent.serving(v1.digest, "chat")
    canary = await agent.serving(v1.digest, "chat-canary")
    assert chat.path == canary.path
    assert os.listdir(agent.data_dir / "versions") == [hex_of(v1.digest)]
    links = {os.readlink(agent.data_dir / "deployments" / d / "current") for d in ("chat", "chat-canary")}
    assert links == {f"../../versions/{hex_of(v1.digest)}"}
    counters = (await agent.status()).counters
    assert counters.bytes_downloaded == v1.total_size
    starts = [(s.blob, s.start) for s in origin.served]
    assert len(starts) == len(set(starts)), "a chunk was downloaded twice"
