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
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, start_cache, ticket
from weightship.schemas import TrackerSources

pytestmark = pytest.mark.timeout(240)

#: seconds between the hog's rounds of asking
HOG_EVERY = 2.0


@pytest.fixture
async def cache(tmp_path: Path, fleet: Fleet, model: str) -> AsyncIterator[AgentProcess]:
    """A cluster cache (with the tracker, 8 upstream slots), stopped at the end."""
    process = start_cache(tmp_path, fleet, f"{model[:50]}-cache")
    await process.ready()
    await eventually(lambda: "tickets.keys_read" in process.log(), 30, "the cache to read the ticket keys")
    yield process
    await process.close()


async def _fetch_time(fleet: Fleet, node: AgentProcess, deployment: str, model: str, label: str, digest: str) -> float:
    fleet.point(deployment, model, label)
    started = time.monotonic()
    await node.serving(digest, deployment, within=120)
    return time.monotonic() - started


async def test_a_node_re_asking_for_upstream_grants_leaves_another_nodes_fetch_within_twice_normal(
    fleet: Fleet, cache: AgentProcess, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1, v2, v3 = (fleet.publish(make_model(f"m{i}", tensors_mb=4, seed=60 + i), model, f"v{i}") for i in (1, 2, 3))
    tracker = peer_url(cache)
    flags = ["--peer-listen", "127.0.0.1:0", "--cluster-cache", tracker]
    fleet.point(f"{deployment}-hog", model, "v3")
    hog_token = ticket(fleet, f"{model[:50]}-hog", [f"{deployment}-hog"], [v3.digest])
    hog_chunks = [c for f in v3.files for c in f.chunks][:16]

    # normal: one node fetches 4 MiB through the cache with nobody else asking
    plain = spawn(f"{model[:50]}-plain", deployments=[f"{deployment}-plain"], extra=flags)
    await plain.ready()
    normal = await _fetch_time(fleet, plain, f"{deployment}-plain", model, "v1", v1.digest)

    granted: list[int] = []
    stop = asyncio.Event()

    async def hog() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while not stop.is_set():
                held = 0
                for chunk in hog_chunks:
                    response = await http.get(f"{tracker}/v1/tracker/sources",
                                              params={"version": v3.digest, "chunk": chunk},
                                              headers={"Authorization": f"Ticket {hog_token}"})  # fmt: skip
                    assert response.status_code == 200, response.text
                    held += TrackerSources.model_validate_json(response.content).upstream_allowed
                granted.append(held)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), HOG_EVERY)

    hogging = asyncio.create_task(hog())
    try:
        await eventually(lambda: len(granted) >= 1, 30, "the hog's first round")
        victim = spawn(f"{model[:50]}-victim", deployments=[f"{deployment}-victim"], extra=flags)
        await victim.ready()
        hogged = await _fetch_time(fleet, victim, f"{deployment}-victim", model, "v2", v2.digest)
    finally:
        stop.set()
        await hogging
    print(f"4 MiB through the cache: normal {normal:.2f}s, beside a hog re-asking every {HOG_EVERY:.0f}s "
          f"{hogged:.2f}s ({hogged / normal:.1f}x); the hog held {max(granted)} of 8 upstream grants")  # fmt: skip
    assert max(granted) <= 4, granted
    assert hogged <= 2 * normal
