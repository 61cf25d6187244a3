"""Anti-rollback: a lower epoch is refused (and reported), also after a restart; a real rollback is a higher epoch."""

from __future__ import annotations

import pytest

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet_fakes import FakeControlPlane, Pointer
from weightship.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_stale_lower_epoch_pointer_is_refused_and_reported(
    spawn: Spawn, fake_cp: FakeControlPlane, versions: dict[str, Manifest]
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    await fake_cp.force_pointer("chat", Pointer("m", v1.digest, epoch=1))
    agent = spawn("node-e")
    await agent.ready()
    await agent.serving(v1.digest)
    await fake_cp.force_pointer("chat", Pointer("m", v2.digest, epoch=5, previous_stable=v1.digest))
    await agent.serving(v2.digest)

    # A control plane restored from an old backup (or a replayed answer) says epoch 3 -> v1.
    await fake_cp.force_pointer("chat", Pointer("m", v1.digest, epoch=3))

    async def refused() -> list[str] | None:
        node = fake_cp.node("node-e")
        hb = node.heartbeat if node else None
        return hb.refused if hb and hb.refused else None

    reports = await eventually(refused, 10, "the refusal in a heartbeat")
    assert any("epoch=3" in r and "accepted epoch 5" in r for r in reports), reports
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.epoch) == (v2.digest, 5)

    # The highest accepted epoch is on disk: after a restart the stale pointer is still refused.
    agent.stop()
    agent.start()
    await agent.ready()
    await eventually(lambda: agent.log().count("deploy.refused") >= 2, 20, "the refusal after the restart")
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.epoch) == (v2.digest, 5)

    # A deliberate rollback arrives as a higher epoch naming the older digest: applied, nothing downloaded.
    before = (await agent.status()).counters.bytes_downloaded
    await fake_cp.force_pointer("chat", Pointer("m", v1.digest, epoch=6, previous_stable=v2.digest))
    view = await agent.serving(v1.digest)
    assert view.epoch == 6
    assert (await agent.status()).counters.bytes_downloaded == before == 0
