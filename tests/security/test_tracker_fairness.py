"""A node that hogs the tracker's upstream grants cannot freeze the cluster's fetches.

Threat: a node with a genuine ticket asks the tracker for many chunks nobody holds and asks again
every few seconds without ever fetching them. If asking renewed its grants and nothing capped
them per node, it would hold every cluster-wide upstream slot, and every other node would wait
(the tracker tells it to) until its own wait limit ran out. Grants are capped per node, expire
however often a node asks, and freed slots go to queued nodes first. Real control plane, cluster
cache (the tracker) and node processes; the hog speaks HTTP with a genuine ticket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, ticket
from weightship.schemas import TrackerSources

pytestmark = pytest.mark.timeout(240)

#: seconds between the hog's rounds of asking
HOG_EVERY = 2.0
#: fetches measured on each side (each a fresh 4 MiB version, so the cache must read it upstream)
ROUNDS = 2
#: seconds of scheduling noise allowed on top of twice the normal time
JITTER = 0.5


@pytest.fixture
def cache(cluster_cache: AgentProcess) -> AgentProcess:
    """The cluster cache (``cluster_cache``)."""
    return cluster_cache


async def _fetch_time(fleet: Fleet, node: AgentProcess, deployment: str, model: str, label: str, digest: str) -> float:
    fleet.point(deployment, model, label)
    started = time.monotonic()
    await node.serving(digest, deployment, within=120)
    return time.monotonic() - started


async def test_a_node_re_asking_for_upstream_grants_leaves_another_nodes_fetch_within_twice_normal(
    fleet: Fleet, cache: AgentProcess, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    labels = [f"v{i}" for i in range(1, 2 * ROUNDS + 1)]
    versions = {label: fleet.publish(make_model(label, tensors_mb=4, seed=60 + i), model, label)
                for i, label in enumerate([*labels, "hogged"])}  # fmt: skip
    tracker = peer_url(cache)
    flags = ["--peer-listen", "127.0.0.1:0", "--cluster-cache", tracker]
    hogged = versions["hogged"]
    fleet.point(f"{deployment}-hog", model, "hogged")
    hog_token = ticket(fleet, f"{model[:50]}-hog", [f"{deployment}-hog"], [hogged.digest])
    hog_chunks = [c for f in hogged.files for c in f.chunks][:16]
    plain = spawn(f"{model[:50]}-plain", deployments=[f"{deployment}-plain"], extra=flags)
    victim = spawn(f"{model[:50]}-victim", deployments=[f"{deployment}-victim"], extra=flags)
    await plain.ready()
    await victim.ready()

    granted: list[int] = []
    hogging = asyncio.Event()

    async def hog() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                await hogging.wait()
                held = 0
                for chunk in hog_chunks:
                    response = await http.get(f"{tracker}/v1/tracker/sources",
                                              params={"version": hogged.digest, "chunk": chunk},
                                              headers={"Authorization": f"Ticket {hog_token}"})  # fmt: skip
                    assert response.status_code == 200, response.text
                    held += TrackerSources.model_validate_json(response.content).upstream_allowed
                granted.append(held)
                await asyncio.sleep(HOG_EVERY)  # ok-sleep: deliberate pacing, not a wait for a condition

    # rounds interleaved, so that a change in this machine's load falls on both sides alike
    normal: list[float] = []
    beside: list[float] = []
    task = asyncio.create_task(hog())
    try:
        for i in range(ROUNDS):
            first, second = labels[2 * i], labels[2 * i + 1]
            normal.append(await _fetch_time(fleet, plain, f"{deployment}-plain", model, first, versions[first].digest))
            hogging.set()
            await eventually(lambda: len(granted) >= 1, 30, "the hog's first round")
            beside.append(
                await _fetch_time(fleet, victim, f"{deployment}-victim", model, second, versions[second].digest)
            )
            hogging.clear()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    print(f"4 MiB through the cache, {ROUNDS} rounds: normal {' '.join(f'{t:.2f}' for t in normal)}s, beside a hog "
          f"re-asking every {HOG_EVERY:.0f}s {' '.join(f'{t:.2f}' for t in beside)}s "
          f"({sum(beside) / sum(normal):.1f}x); the hog held {max(granted)} of 8 upstream grants")  # fmt: skip
    assert max(granted) <= 4, granted
    # Half a second of slack for a loaded 2-core machine: sub-second fetches jitter by that much; the
    # unfair tracker this guards against stalled the other node for more than a minute.
    assert sum(beside) <= 2 * sum(normal) + JITTER, (beside, normal)
