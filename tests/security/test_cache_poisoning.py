"""Cache poisoning: a cache stores and serves only bytes it hashed to the chunk's digest itself.

Threat: a corrupt or malicious source above a cache (the origin's bytes altered in transit or at
rest, or a compromised upstream cache) plants bad bytes in the cache, which would then feed them
to every GPU node of the cluster. The cache must reject them before storing or serving, tell the
requester (502 upstream_corrupt), name the source in its logs and metrics, and not keep trusting
a corrupt upstream. Real control plane (origin blob URLs through the fault proxy, which flips a
byte on demand) and cache processes; the hostile upstream cache is a small HTTP server that
answers ``/v1/chunks`` with flipped bytes, as a compromised host would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import chunk_bytes, chunk_request, largest_file, metric, peer_url, start_cache, ticket
from weightship.testing import FaultProxy, problem

pytestmark = pytest.mark.timeout(120)

CORRUPT = 'weightship_cache_upstream_corrupt_total{{source="{}"}}'


async def _running(cache: AgentProcess) -> str:
    await cache.ready()
    await eventually(lambda: "tickets.keys_read" in cache.log(), 30, f"cache {cache.name} to read the ticket keys")
    return peer_url(cache)


@pytest.fixture
async def caches() -> AsyncIterator[list[AgentProcess]]:
    """Started caches, stopped at the end."""
    started: list[AgentProcess] = []
    yield started
    for cache in started:
        await cache.close()


@pytest.fixture
async def hostile_upstream(tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """An upstream that answers every chunk request with 64 KiB of the wrong bytes; (URL, paths asked)."""
    asked: list[str] = []

    async def chunk(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(body=b"\xee" * 65536, headers={"X-Weightship-Chunk": "sha256:" + request.match_info["c"]})

    app = web.Application()
    app.router.add_get("/v1/chunks/{c}", chunk)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", asked
    await runner.cleanup()


async def test_corrupt_origin_bytes_are_rejected_not_stored_and_reported(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    caches: list[AgentProcess],
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    source = make_model("m1", tensors_mb=0.25, seed=31)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    # read-ahead off: the counts below are of this one chunk's fetch
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache", ["--read-ahead", "0"])
    caches.append(cache)
    base = await _running(cache)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    url, chunk = chunk_request(base, v1, big, 0)
    proxy.corrupt = lambda _blob, _start: True
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(url, headers=auth)
        assert response.status_code == 502, response.text
        assert problem(response)["code"] == "upstream_corrupt"
        assert not (cache.data_dir / "chunks" / chunk[:2] / chunk).exists()  # nothing stored
        assert metric(base, CORRUPT.format("origin")) == 1
        assert "cache.upstream_corrupt" in cache.log()
        assert f"origin blob {v1.files[big].sha256}" in cache.log()
        proxy.corrupt = lambda _blob, _start: False
        healed = await http.get(url, headers=auth)  # fetched afresh: the bad bytes were never kept
    assert healed.status_code == 200
    assert healed.content == chunk_bytes(source, v1, big, 0)


async def test_a_poisoned_upstream_cache_is_rejected_reported_and_avoided(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    caches: list[AgentProcess],
    hostile_upstream: tuple[str, list[str]],
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    hostile, asked = hostile_upstream
    source = make_model("m1", tensors_mb=0.25, seed=32)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache", ["--upstream", hostile, "--read-ahead", "0"])
    caches.append(cache)
    base = await _running(cache)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    url, chunk = chunk_request(base, v1, big, 0)
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(url, headers=auth)
        assert response.status_code == 502, response.text
        assert not (cache.data_dir / "chunks" / chunk[:2] / chunk).exists()
        assert metric(base, CORRUPT.format("upstream")) == 1
        assert f"source={hostile}" in cache.log()
        # The corrupt upstream is avoided: the next miss goes to the origin and is verified there.
        again = await http.get(url, headers=auth)
    assert again.status_code == 200
    assert again.content == chunk_bytes(source, v1, big, 0)
    assert len(asked) == 1
    assert metric(base, 'weightship_cache_fetches_total{source="origin"}') == 1
