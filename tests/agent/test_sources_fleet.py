"""Sources in order with real processes: control plane, a cluster cache running the tracker, node agents.

The poisoned peer is a real agent whose copy of the version was corrupted on disk after it
verified it: its peer listener sends those bytes (sendfile, no re-hash), as a disk fault or a
hostile host would.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, start_cache
from weightship.digests import hex_of
from weightship.schemas import DeploymentStatus
from weightship.testing import FaultProxy

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cache(cluster_cache: AgentProcess) -> AgentProcess:
    """The cluster cache (``cluster_cache``)."""
    return cluster_cache


def _poison(agent: AgentProcess, digest: str) -> None:
    """Flip one byte in every chunk of every file of ``agent``'s ready copy of ``digest``, in place."""
    root = agent.data_dir / "versions" / hex_of(digest)
    for path in root.rglob("*"):
        if path.is_file() and ".weightship" not in path.parts:
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
            with open(path, "r+b") as handle:
                size = path.stat().st_size
                for offset in range(0, size, 64 * 1024):
                    handle.seek(offset)
                    byte = handle.read(1)
                    handle.seek(offset)
                    handle.write(bytes([byte[0] ^ 0xFF]))


async def test_a_poisoned_peer_is_rejected_reported_and_avoided_and_the_node_finishes_from_the_cache(
    fleet: Fleet,
    proxy: FaultProxy,
    cache: AgentProcess,
    spawn: Spawn,
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    v1 = fleet.publish(make_model("p1", tensors_mb=0.5, seed=31), model, "v1")
    fleet.point(deployment, model, "v1")
    cache_url = peer_url(cache)
    flags = ["--peer-listen", "127.0.0.1:0", "--cluster-cache", cache_url, "--upload-concurrency", "64"]
    first = spawn(f"{model[:50]}-a", extra=flags)
    await first.ready()
    await first.serving(v1.digest)
    first_status = await first.status()
    assert first_status.counters.sources["cluster_cache"].chunks > 0  # through the cache, not the origin
    assert first_status.counters.sources["origin"].chunks == 0
    await eventually(lambda: "sources.announced" in first.log(), 30, "the first node to announce what it holds")
    _poison(first, v1.digest)

    second = spawn(f"{model[:50]}-b", extra=flags)
    await second.ready()
    await second.serving(v1.digest)  # ready means every chunk verified against the manifest
    status = await second.status()
    tally = status.counters.sources
    assert tally["peer"].errors >= 1
    assert status.counters.chunks_rejected >= 1
    assert "sources.parent_reported" in second.log()
    assert "reason=corrupt" in second.log()
    # after the report the poisoned peer is avoided: the rest came from the cache
    assert tally["cluster_cache"].chunks >= 1
    assert tally["peer"].chunks == 0
    assert "tracker.reported" in cache.log()
    # the origin sent each chunk to the cache at most once for both nodes
    starts = [(s.blob, s.start) for s in proxy.served]
    assert len(starts) == len(set(starts))

    # `weightship status` shows origin egress against bytes delivered to nodes
    def delivered() -> DeploymentStatus | None:
        with fleet.cp.client(ADMIN_TOKEN) as admin:
            found = admin.deployment_status(deployment)
        return found if found.delivered_bytes >= 2 * v1.total_size and found.origin_bytes >= v1.total_size else None

    fleet_status = await eventually(delivered, 30, "both nodes' heartbeats to count their bytes")
    # the nodes fetched from the cache and each other, never the origin; the cache read v1 from the
    # origin, and its reads are the deployment's origin egress
    assert fleet_status.origin_bytes >= v1.total_size


async def test_a_restarted_tracker_recovers_from_re_announcements_and_peers_serve_again(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    spawn: Spawn,
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    v1 = fleet.publish(make_model("r1", tensors_mb=0.5, seed=41), model, "v1")
    fleet.point(deployment, model, "v1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fixed = ["--peer-listen", f"127.0.0.1:{port}"]
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache", fixed)
    try:
        await cache.ready()
        cache_url = f"http://127.0.0.1:{port}"
        flags = ["--peer-listen", "127.0.0.1:0", "--cluster-cache", cache_url, "--announce-interval", "0.5"]
        first = spawn(f"{model[:50]}-a", extra=flags)
        await first.ready()
        await first.serving(v1.digest)
        await eventually(lambda: "sources.announced" in first.log(), 30, "the first node to announce")
        cache.stop()  # the tracker's state is gone with the process
        before = first.log().count("sources.announced")
        await eventually(lambda: "sources.announce_failed" in first.log(), 30, "an announcement to fail")
        cache.start()
        await cache.ready()
        await eventually(lambda: "tickets.keys_read" in cache.log(), 30, "the cache to read the ticket keys")
        await eventually(
            lambda: first.log().count("sources.announced") > before or None, 30, "the first node to re-announce"
        )
        second = spawn(f"{model[:50]}-b", extra=flags)
        await second.ready()
        await second.serving(v1.digest)
        tally = (await second.status()).counters.sources
        assert tally["peer"].chunks > 0  # the restarted tracker knew the first node again
        assert tally["peer"].errors == 0
    finally:
        await cache.close()


async def test_a_cache_killed_mid_rollout_leaves_the_nodes_to_fall_back_and_finish(
    fleet: Fleet,
    proxy: FaultProxy,
    cache: AgentProcess,
    spawn: Spawn,
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    v1 = fleet.publish(make_model("k1", tensors_mb=2.0, seed=51), model, "v1")
    proxy.hold_after = 2  # the origin answers the cache twice, then stalls: the rollout is under way
    fleet.point(deployment, model, "v1")
    flags = ["--peer-listen", "127.0.0.1:0", "--cluster-cache", peer_url(cache)]
    nodes = [spawn(f"{model[:50]}-{i}", extra=flags) for i in range(2)]
    for node in nodes:
        await node.ready()

    async def from_cache() -> int | None:
        got = [(await node.status()).counters.sources["cluster_cache"].chunks for node in nodes]
        return sum(got) or None

    await eventually(from_cache, 30, "the nodes to receive chunks through the cache")
    await eventually(lambda: proxy.held() or None, 30, "the fetch to stall at the origin")
    cache.kill9()
    proxy.release()
    for node in nodes:
        await node.serving(v1.digest)  # ready: every chunk verified against the manifest
    tallies = [(await node.status()).counters.sources for node in nodes]
    assert sum(t["origin"].chunks for t in tallies) > 0  # what the cache no longer could, the origin sent
    assert sum(t["cluster_cache"].errors for t in tallies) > 0
