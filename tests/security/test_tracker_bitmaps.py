"""Oversized have-bitmaps at the tracker: refused before they cost anything, so the cache stays responsive.

Threat: a node with a genuine ticket announces bitmaps far longer than the version has chunks;
expanding every set bit before checking the count costs the cluster cache (which runs the
tracker) a second of CPU per megabyte, and its ``/healthz`` and chunk serving stall with it.
The bitmap's length is checked against the version's chunk count before it is decoded; bodies
past the listener's limit are refused unread. Real control plane and cluster cache processes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agent.peerserver import MAX_BODY
from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, ticket

pytestmark = pytest.mark.timeout(180)

#: raw bitmap bytes per announcement (about 1 MB of JSON once base64-encoded), and how many
BITMAP_BYTES = 750_000
ANNOUNCEMENTS = 40  # 30 MB of bitmaps at least
#: seconds each of the four senders waits between announcements (the whole flood lasts about 4 s)
PACE = 0.4
#: /healthz samples, one every 20 ms, from the flood's start
PROBES = 150


@pytest.fixture
def cache(cluster_cache: AgentProcess) -> AgentProcess:
    """The cluster cache (``cluster_cache``)."""
    return cluster_cache


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, -(-len(ordered) * 99 // 100) - 1)]


async def test_thirty_megabytes_of_oversized_bitmaps_leave_the_cache_healthz_fast(
    fleet: Fleet, cache: AgentProcess, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.25, seed=41), model, "v1")
    fleet.point(deployment, model, "v1")
    base = peer_url(cache)
    name = f"{model[:50]}-flooder"
    token = ticket(fleet, name, [deployment], [v1.digest])
    bitmap = base64.b64encode(b"\xff" * BITMAP_BYTES).decode()
    # encoded once: the test's own event loop must not stall the probes it times
    body = json.dumps({"node": name, "address": "http://127.0.0.1:9", "upload_slots_free": 0,
                       "versions": {v1.digest: {"have": bitmap}}}).encode()  # fmt: skip
    headers = {"Authorization": f"Ticket {token}", "Content-Type": "application/json"}
    latencies: list[float] = []
    statuses: list[int] = []
    details: set[str] = set()
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(f"{base}/healthz")).status_code == 200
        quiet = []
        for _ in range(PROBES):  # the same probes with no flood: what this machine gives anyway
            started = time.monotonic()
            await http.get(f"{base}/healthz")
            quiet.append(time.monotonic() - started)
            await asyncio.sleep(0.02)  # ok-sleep: deliberate pacing, not a wait for a condition

        async def probe() -> None:
            while not done.is_set():
                started = time.monotonic()
                response = await http.get(f"{base}/healthz")
                latencies.append(time.monotonic() - started)
                assert response.status_code == 200
                await asyncio.sleep(0.02)  # ok-sleep: deliberate pacing, not a wait for a condition

        def flood() -> None:
            # four senders in threads (the probes' event loop must not time its own sends), each an
            # announcement every PACE seconds, until ANNOUNCEMENTS were sent
            with httpx.Client(timeout=30) as own:
                while len(statuses) < ANNOUNCEMENTS:
                    response = own.post(f"{base}/v1/tracker/announce", content=body, headers=headers)
                    statuses.append(response.status_code)
                    details.add(str(response.json().get("detail", ""))[:40])
                    time.sleep(PACE)  # ok-sleep: deliberate pacing, not a wait for a condition

        prober = asyncio.create_task(probe())
        started = time.monotonic()
        try:
            await asyncio.gather(*(asyncio.to_thread(flood) for _ in range(4)))
            took = time.monotonic() - started
            await eventually(lambda: len(latencies) >= PROBES, 30, f"{PROBES} /healthz probes")
        finally:
            done.set()
            await prober
        # one body past the listener's limit is refused before it is read
        huge = await http.post(f"{base}/v1/tracker/announce", content=b"{" + b" " * (MAX_BODY + 1),
                               headers={"Authorization": f"Ticket {token}", "Content-Type": "application/json"})  # fmt: skip
    p99 = _p99(latencies)
    print(f"{len(statuses)} announcements of {BITMAP_BYTES} bitmap bytes in {took:.1f}s: /healthz p99 "
          f"{p99 * 1000:.1f} ms, max {max(latencies) * 1000:.0f} ms over {len(latencies)} probes; "
          f"without the flood p99 {_p99(quiet) * 1000:.1f} ms")  # fmt: skip
    assert set(statuses) == {400}, statuses
    assert all(d.startswith("have-bitmap is") for d in details), details  # refused for its length, unexpanded
    assert huge.status_code == 413
    assert p99 < 0.100
