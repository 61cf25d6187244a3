"""A cluster cache that stops answering (SIGSTOP: alive, connections accepted, nothing sent) costs a node one timeout, not one per chunk.

Threat: a cache or peer that hangs (a frozen process, a host under a kernel stall, or a hostile
one that accepts and says nothing) makes every chunk queued behind it wait out its own timeout,
so a node takes minutes to fetch what the origin would give it in a second. A source that lets a
read time out without answering is marked down for a backoff period, the reads waiting on it are
cut off at once, and chunks skip it; the tracker (on the same cache) is skipped likewise. Real
control plane, cache and node processes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, Spawn
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url
from weightship.testing import TEST_CHUNK

pytestmark = pytest.mark.timeout(240)

#: a node's timeout for one chunk from a cache: 4 x (slow floor 2 s + chunk / 5 MB/s), ``agent.sources``
CACHE_TIMEOUT = 4 * (2.0 + TEST_CHUNK / 5e6)


@pytest.fixture
async def cache(cluster_cache: AgentProcess) -> AsyncIterator[AgentProcess]:
    """The cluster cache (``cluster_cache``), continued before it is stopped."""
    yield cluster_cache
    assert cluster_cache.proc is not None
    if cluster_cache.proc.poll() is None:
        os.kill(cluster_cache.proc.pid, signal.SIGCONT)


async def test_a_frozen_cache_costs_a_node_at_most_two_timeouts_not_one_per_chunk(
    fleet: Fleet, cache: AgentProcess, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=1.75, seed=51), model, "v1")
    v2 = fleet.publish(make_model("m2", tensors_mb=1.75, seed=52), model, "v2")
    chunks = sum(len(f.chunks) for f in v1.files)
    # the same fetch with no cache in the way: the node's normal time on this machine now
    plain = spawn(f"{model[:50]}-plain", deployments=[f"{deployment}-plain"])
    await plain.ready()
    fleet.point(f"{deployment}-plain", model, "v2")
    started = time.monotonic()
    await plain.serving(v2.digest, f"{deployment}-plain")
    normal = time.monotonic() - started

    node = spawn(f"{model[:50]}-node", extra=["--peer-listen", "127.0.0.1:0", "--cluster-cache", peer_url(cache)])
    await node.ready()
    assert cache.proc is not None
    os.kill(cache.proc.pid, signal.SIGSTOP)
    fleet.point(deployment, model, "v1")
    started = time.monotonic()
    await node.serving(v1.digest, within=200)
    frozen = time.monotonic() - started
    print(f"{chunks} chunks behind a SIGSTOPped cache: {frozen:.1f}s (normal {normal:.1f}s, one cache timeout "
          f"{CACHE_TIMEOUT:.1f}s)")  # fmt: skip
    assert frozen - normal <= 2 * CACHE_TIMEOUT
    assert "sources.source_down" in node.log()
