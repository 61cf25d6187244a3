"""A corrupt origin blob: fetched a bounded number of times, then reported as such, and shown to operators.

The fault proxy flips a byte of one chunk on every trip, as a bad copy at the origin (bit rot, a
bad restore, a tampered object) would. The node must not re-fetch it endlessly: each chunk gets
a few tries with backoff, then the version fails with reason ``corrupt_origin`` naming blob and
chunk, the node waits minutes before trying again, and ``weightship status``/``nodes`` say so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from weightship.cli import app
from weightship.manifest import Manifest
from weightship.schemas import FetchFailure, VersionInventory, VersionState
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: how often the agent tries one chunk in a fetch (its default)
CHUNK_ATTEMPTS = 5


async def holds_for(probe: Callable[[], bool], seconds: float, what: str) -> None:
    """Check ``probe`` over a window of ``seconds``: it must stay true throughout."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert probe(), f"{what} stopped holding"
        await asyncio.sleep(0.1)  # ok-sleep: sampling interval of an observation window


def cli(fleet: Fleet, *args: str) -> str:
    """Run the ``weightship`` CLI against the fleet's control plane; its output, on one wide terminal."""
    env = {"WEIGHTSHIP_URL": fleet.cp.url, "WEIGHTSHIP_TOKEN": ADMIN_TOKEN, "COLUMNS": "1000"}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def test_a_corrupt_origin_chunk_is_fetched_a_bounded_number_of_times_and_reported(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    weights = next(f for f in v2.files if f.path.endswith(".safetensors"))
    bad = 2 * v2.chunk_size
    fleet.point(deployment, model, "v1")
    agent = spawn("node-rot")
    await agent.ready()
    await agent.serving(v1.digest)

    proxy.corrupt = lambda blob, start: blob == weights.sha256 and start == bad
    fleet.point(deployment, model, "v2")

    def reported() -> VersionInventory | None:
        node = fleet.node("node-rot")
        item = next((i for i in node.inventory if i.digest == v2.digest), None) if node else None
        return item if item and item.state == VersionState.failed and item.problem else None

    item = await eventually(reported, 30, "the control plane to hear that v2's origin copy is corrupt")
    problem = item.problem
    assert problem is not None
    assert problem.reason == FetchFailure.corrupt_origin
    assert (problem.blob, problem.file, problem.chunk_index) == (weights.sha256, weights.path, 2)
    assert problem.chunk_digest == weights.chunks[2]
    assert (problem.attempts, problem.chunk_attempts) == (1, CHUNK_ATTEMPTS)
    assert problem.retry_at is not None
    assert problem.retry_at - datetime.now(UTC) > timedelta(minutes=3), "the node backs off for minutes"

    # Bounded: the bad chunk was fetched CHUNK_ATTEMPTS times, and nothing of v2 is fetched again
    # over the next seconds while the node keeps heart-beating.
    def weights_bytes() -> int:
        return sum(s.end - s.start for s in proxy.served if s.blob == weights.sha256)

    assert [s.start for s in proxy.served if s.blob == weights.sha256].count(bad) == CHUNK_ATTEMPTS
    fetched = weights_bytes()
    assert fetched <= weights.size + (CHUNK_ATTEMPTS - 1) * v2.chunk_size
    seen_before = fleet.node("node-rot")
    assert seen_before is not None
    await holds_for(lambda: weights_bytes() == fetched, 3.0, "no refetch of the corrupt blob")
    seen_after = fleet.node("node-rot")
    assert seen_after is not None
    assert seen_before.last_seen is not None
    assert seen_after.last_seen is not None
    assert seen_after.last_seen > seen_before.last_seen, "the node kept reporting meanwhile"
    # The control plane logs the bad origin copy once, not with every heartbeat.
    assert fleet.cp.log().count(f"origin.blob_corrupt node=node-rot version={v2.digest} blob={weights.sha256}") == 1
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.ready) == (v1.digest, True), "the node keeps serving v1"

    # Operators see which blob and which chunk, in both views.
    nodes = cli(fleet, "nodes")
    assert f"corrupt origin blob {weights.sha256[:12]} chunk 2" in nodes
    assert "1 failed" in nodes
    status = cli(fleet, "status", deployment)
    assert f"node-rot stable {v2.digest.removeprefix('sha256:')[:12]}: failed since" in status
    assert (
        f"corrupt origin blob {weights.sha256} chunk 2 ({weights.path}, expected sha256:{weights.chunks[2]})" in status
    )
    assert "retries at" in status

    # The origin is repaired and the operator re-points: the node retries at once, fetching only
    # the chunk that failed, and the problem is gone from the status.
    proxy.corrupt = lambda _blob, _start: False
    fleet.point(deployment, model, "v2")
    await agent.serving(v2.digest, within=30)
    assert weights_bytes() == fetched + min(v2.chunk_size, weights.size - bad)
    with fleet.cp.client() as admin:
        await eventually(
            lambda: not any(v.problems for v in admin.deployment_status(deployment).versions),
            15,
            "the status to clear the problem",
        )
