"""Tracker requests do not amplify onto the control plane, and one node's requests are rate-limited.

Threat: a node holding a genuine ticket for a version no pointer names any more (a canary that was
rolled back within the ticket's life) asks the tracker about it again and again. Each request for a
version the cluster cache does not know made the cache re-read the pointers from the control
plane: one control-plane read per tracker request. Now a miss is cached (and concurrent misses
share one lookup), and each node's requests are rate-limited (429 past its bucket). Real control
plane, cluster cache (tracker) and HTTP; control-plane reads are counted as the cache's
``cache.refreshed`` events (each one is a ``GET /v1/deployments``, plus manifests of new versions).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agent.tracker_limits import REQUEST_BURST, REQUEST_RATE
from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, ticket

pytestmark = pytest.mark.timeout(180)

REQUESTS = 600
AT_ONCE = 20


def _reads(cache: AgentProcess) -> int:
    return cache.log().count("cache.refreshed")


async def test_requests_for_a_version_no_pointer_names_cost_the_control_plane_a_handful_of_reads(
    fleet: Fleet, cluster_cache: AgentProcess, model: str, make_model: Callable[..., Path]
) -> None:
    versions = [fleet.publish(make_model(f"m{i}", tensors_mb=0.05, seed=50 + i), model[:60], f"v{i}") for i in (1, 2, 3)]
    fleet.point(model[:60], model[:60], "v1")
    gone = versions[0]
    # a genuine ticket for v1, bound to the tracker, taken while a pointer named v1 ...
    stale = ticket(fleet, f"{model[:50]}-asker", [model[:60]], [gone.digest], audience=cluster_cache.name)
    fleet.point(model[:60], model[:60], "v2")
    fleet.point(model[:60], model[:60], "v3")  # ... which none names now (stable v3, previous v2)
    moved = _reads(cluster_cache)
    await eventually(lambda: _reads(cluster_cache) > moved, 30, "the cache to re-read the pointers")

    url = f"{peer_url(cluster_cache)}/v1/tracker/sources?version={gone.digest}&chunk={gone.files[0].chunks[0]}"
    headers = {"Authorization": f"Ticket {stale}"}
    statuses: Counter[int] = Counter()
    before = _reads(cluster_cache)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=AT_ONCE)) as http:
        for _batch in range(REQUESTS // AT_ONCE):
            answers = await asyncio.gather(*(http.get(url, headers=headers) for _ in range(AT_ONCE)))
            statuses.update(a.status_code for a in answers)
    elapsed = time.monotonic() - started
    reads = _reads(cluster_cache) - before

    print(f"{REQUESTS} tracker requests in {elapsed:.2f} s: {dict(statuses)}; control-plane reads: {reads}")
    assert set(statuses) <= {404, 429}, statuses
    # one lookup for the miss, plus the cache's own periodic refresh (every 5 s) while the requests ran
    assert reads <= 2 + int(elapsed / 5), reads
    # the rate limit: no more admitted than the bucket and its refill allow
    assert statuses[404] <= REQUEST_BURST + REQUEST_RATE * elapsed + 1, (statuses, elapsed)
