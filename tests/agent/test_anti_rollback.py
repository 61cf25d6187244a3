"""Anti-rollback: a control plane restored from an old backup is refused (and reported), also after a restart.

A deliberate rollback is a higher epoch naming an older digest: applied, nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet import Fleet
from weightship.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_a_control_plane_restored_from_an_old_backup_is_refused_and_reported(
    tmp_path: Path, spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    fleet.point(deployment, model, "v1")
    agent = spawn("node-e")
    await agent.ready()
    await agent.serving(v1.digest)
    fleet.point(deployment, model, "v2")
    await agent.serving(v2.digest)
    backup = tmp_path / "cp-backup.db"
    fleet.cp.backup(backup)  # the nightly backup: v2 at epoch 2

    # A deliberate rollback arrives as a higher epoch naming the older digest: applied, nothing downloaded.
    before = (await agent.status()).counters.bytes_downloaded
    assert fleet.rollback(deployment).epoch == 3
    rolled_back = await agent.serving(v1.digest)
    assert rolled_back.epoch == 3
    assert (await agent.status()).counters.bytes_downloaded == before

    # The control plane crashes and its database is restored from the backup: it says epoch 2 -> v2.
    fleet.cp.kill()
    fleet.cp.restore(backup)
    fleet.cp.start()
    await fleet.cp.ready()
    with fleet.cp.client() as admin:
        restored = admin.get_deployment(deployment)
    assert (restored.epoch, restored.stable) == (2, v2.digest)

    def refused() -> list[str] | None:
        node = fleet.node("node-e")
        return node.refused if node and node.refused else None

    reports = await eventually(refused, 15, "the refusal in a heartbeat, at GET /v1/nodes")
    assert any(f"deployment={deployment} epoch=2" in r and "accepted epoch 3" in r for r in reports), reports
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.epoch) == (v1.digest, 3), "v2 is on disk, yet the node must not switch back to it"

    # The highest accepted epoch is on disk: after a restart the stale pointer is still refused.
    agent.stop()
    agent.start()
    await agent.ready()
    await eventually(lambda: agent.log().count("deploy.refused") >= 2, 20, "the refusal after the restart")
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.epoch) == (v1.digest, 3)

    # The runbook's way out: move the restored pointer forward past the accepted epoch.
    fleet.rollback(deployment)  # epoch 3: v1, what the node already serves
    moved = fleet.point(deployment, model, "v2")
    assert moved.epoch == 4
    forward = await agent.serving(v2.digest)
    assert forward.epoch == 4
    assert (await agent.status()).counters.bytes_downloaded == 0, "v2 was on disk all along"
