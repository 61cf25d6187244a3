"""An origin serving corrupted bytes through a fault-injecting proxy: chunks rejected, retried, never ready."""

from __future__ import annotations

import pytest

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet import Fleet
from weightship.digests import hex_of
from weightship.manifest import Manifest
from weightship.testing import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_corrupted_chunks_are_rejected_and_fetched_again(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1 = versions["v1"]
    weights = next(f for f in v1.files if f.path.endswith(".safetensors"))
    bad_offsets = {0, 3 * v1.chunk_size, 7 * v1.chunk_size}
    seen: set[int] = set()

    def corrupt_first_time(blob: str, start: int) -> bool:
        # Each chosen chunk is damaged on its first trip only; the retry gets good bytes.
        if blob == weights.sha256 and start in bad_offsets and start not in seen:
            seen.add(start)
            return True
        return False

    proxy.corrupt = corrupt_first_time
    fleet.point(deployment, model, "v1")
    agent = spawn("node-c")
    await agent.ready()
    await agent.serving(v1.digest)
    status = await agent.status()
    assert len(proxy.corrupted) == 3
    assert status.counters.chunks_rejected == 3
    assert agent.log().count("fetch.chunk_retry") == 3
    ready_file = agent.data_dir / "versions" / hex_of(v1.digest) / weights.path
    assert ready_file.read_bytes() == (fleet.cp.workdir / "origin" / "blobs" / "sha256" / weights.sha256).read_bytes()


async def test_a_chunk_corrupted_every_time_fails_the_fetch_and_the_old_version_keeps_serving(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, versions: dict[str, Manifest], model: str, deployment: str
) -> None:
    v1, v2 = versions["v1"], versions["v2"]
    weights = next(f for f in v2.files if f.path.endswith(".safetensors"))
    bad = 2 * v2.chunk_size
    fleet.point(deployment, model, "v1")
    agent = spawn("node-p", extra=["--chunk-attempts", "3"])
    await agent.ready()
    await agent.serving(v1.digest)

    proxy.corrupt = lambda blob, start: blob == weights.sha256 and start == bad
    fleet.point(deployment, model, "v2")
    # One report, as the control plane stores it: v2 failed, why, the node's errors and counters.
    failure = await eventually(lambda: fleet.failed("node-p", v2.digest), 30, "the control plane to hear v2 failed")
    assert "failed 3 times" in failure.error
    assert "hash to" in failure.error
    assert any("failed 3 times" in e for e in failure.node.health.errors)
    assert failure.node.counters.chunks_rejected >= 3
    view = await agent.deployment()
    assert view is not None
    assert (view.digest, view.ready) == (v1.digest, True), "the node must keep serving v1"
    assert not (agent.data_dir / "versions" / hex_of(v2.digest)).exists()
    # The bad bytes never reached the staged file: the chunk's range was never written.
    staged = agent.data_dir / "staging" / hex_of(v2.digest) / weights.path
    length = min(v2.chunk_size, weights.size - bad)
    assert staged.read_bytes()[bad : bad + length] == bytes(length)

    # The origin's copy is bad, so the node waits minutes before it tries again; the operator
    # fixes the origin and re-points the deployment (a new epoch), and the node retries at once,
    # completing v2 from the chunks already verified.
    proxy.corrupt = lambda _blob, _start: False
    served_before = len(proxy.served)
    fleet.point(deployment, model, "v2")
    await agent.serving(v2.digest, within=30)
    refetched = [(s.blob, s.start) for s in proxy.served[served_before:]]
    assert refetched == [(weights.sha256, bad)], "only the chunk that failed is fetched again"
