"""An agent process fetches what its pointer names, switches atomically, and serves it locally."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet import Fleet
from weightship.digests import hex_of
from weightship.layout import read_verification
from weightship.manifest import Manifest
from weightship.schemas import ValidationReport
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_agent_fetches_verifies_and_switches_to_the_pointer(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    fleet.point(deployment, model, "v1")
    agent = spawn("node-a")
    await agent.ready()
    served = await agent.serving(v1.digest)
    assert served.path == str(agent.data_dir.resolve() / "versions" / hex_of(v1.digest))
    assert served.model == model
    assert served.epoch == 1
    for entry in v1.files:
        assert (Path(served.path) / entry.path).stat().st_size == entry.size
        assert not os.access(Path(served.path) / entry.path, os.W_OK) or os.geteuid() == 0
    record = read_verification(Path(served.path))
    assert record is not None
    assert record.digest == v1.digest
    link = agent.data_dir / "deployments" / deployment / "current"
    assert os.readlink(link) == f"../../versions/{hex_of(v1.digest)}"

    fleet.point(deployment, model, "v2")
    switched = await agent.serving(v2.digest)
    assert switched.epoch == 2
    assert os.readlink(link) == f"../../versions/{hex_of(v2.digest)}"
    # both versions stay on disk side by side
    assert (agent.data_dir / "versions" / hex_of(v1.digest)).is_dir()

    def reported() -> bool:
        node = fleet.node("node-a")
        return bool(node and [(d.name, d.digest, d.epoch) for d in node.serving] == [(deployment, v2.digest, 2)])

    await eventually(reported, 10, f"a heartbeat reporting {deployment} at epoch 2")
    report = ValidationReport(deployment=deployment, digest=v2.digest, passed=True, load_seconds=0.5)
    posted = await agent.post("/local/v1/validation", report.model_dump_json().encode())
    assert posted.status_code == 204

    def forwarded() -> bool:
        node = fleet.node("node-a")
        return bool(node and node.validation == [report])

    await eventually(forwarded, 10, "the validation report in a heartbeat")
    status = await agent.status()
    assert {i.digest: i.state.value for i in status.inventory} == {v1.digest: "ready", v2.digest: "ready"}
    # config.json is the same in both: v2's copy was linked from v1, not downloaded
    shared = sum(f.size for f in v2.files if f.sha256 in {g.sha256 for g in v1.files})
    assert shared > 0
    assert status.counters.bytes_downloaded == v1.total_size + v2.total_size - shared
    assert status.counters.bytes_copied_locally == shared
    assert proxy.bytes_served() == status.counters.bytes_downloaded
