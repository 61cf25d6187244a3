"""The cache role: read-through by chunk digest, one upstream fetch per chunk, crash-safe store.

Real processes: the control plane (origin blob URLs through the fault proxy, which counts every
range it serves), a region cache reading from the origin, a cluster cache reading from the region
cache; requesters hold tickets the control plane signed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import chunk_bytes, chunk_request, largest_file, metric, peer_url, start_cache, ticket
from weightship.manifest import Manifest
from weightship.testing import FaultProxy

pytestmark = pytest.mark.timeout(120)

UPLOADS = "weightship_peer_upload_chunks_total"


def fetches(source: str) -> str:
    """The cache's upstream-fetch counter for ``source`` (``upstream`` or ``origin``)."""
    return f'weightship_cache_fetches_total{{source="{source}"}}'


async def running(cache: AgentProcess) -> str:
    """Wait until ``cache`` listens and knows the ticket keys; its peer URL."""
    await cache.ready()
    await eventually(lambda: "tickets.keys_read" in cache.log(), 30, f"cache {cache.name} to read the ticket keys")
    return peer_url(cache)


@pytest.fixture
async def caches(tmp_path: Path, fleet: Fleet, proxy: FaultProxy, model: str) -> AsyncIterator[list[AgentProcess]]:
    """Started caches, stopped at the end."""
    started: list[AgentProcess] = []
    yield started
    for cache in started:
        await cache.close()


async def test_a_hundred_concurrent_requests_for_a_cold_chunk_make_one_upstream_fetch_per_tier(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    caches: list[AgentProcess],
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    source = make_model("m1", tensors_mb=0.5, seed=21)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    # read-ahead off: this counts the fetches of one chunk (read-ahead has its own test)
    region = start_cache(tmp_path, fleet, f"{model[:50]}-region", ["--tier", "region", "--read-ahead", "0"])
    caches.append(region)
    region_url = await running(region)
    cluster = start_cache(
        tmp_path,
        fleet,
        f"{model[:50]}-cluster",
        ["--upstream", region_url, "--upload-concurrency", "128", "--read-ahead", "0"],
    )
    caches.append(cluster)
    cluster_url = await running(cluster)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    url, _chunk = chunk_request(cluster_url, v1, big, 1)
    expected = chunk_bytes(source, v1, big, 1)
    proxy.served = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as http:
        answers = await asyncio.gather(*(http.get(url, headers=auth) for _ in range(100)))
    assert [a.status_code for a in answers] == [200] * 100, {a.status_code: a.text for a in answers}
    assert all(a.content == expected for a in answers)
    start = v1.files[big].chunk_range(1, v1.chunk_size)[0]
    assert [(s.blob, s.start) for s in proxy.served] == [(v1.files[big].sha256, start)]  # the origin: once
    assert metric(region_url, UPLOADS) == 1  # the region cache served the cluster cache once
    assert metric(region_url, fetches("origin")) == 1
    assert metric(cluster_url, fetches("upstream")) == 1
    assert metric(cluster_url, fetches("origin")) == 0
    assert metric(cluster_url, UPLOADS) == 100


async def test_a_cache_killed_and_restarted_serves_its_stored_chunks_without_fetching_again(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    caches: list[AgentProcess],
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    source = make_model("m1", tensors_mb=0.5, seed=22)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache", ["--read-ahead", "0"])
    caches.append(cache)
    url_of = await running(cache)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    count = len(v1.files[big].chunks)
    async with httpx.AsyncClient(timeout=30) as http:
        for index in range(count):
            assert (await http.get(chunk_request(url_of, v1, big, index)[0], headers=auth)).status_code == 200
    origin_reads = len(proxy.served)
    cache.kill9()
    cache.start()
    url_of = await running(cache)
    async with httpx.AsyncClient(timeout=30) as http:
        for index in range(count):
            response = await http.get(chunk_request(url_of, v1, big, index)[0], headers=auth)
            assert response.status_code == 200
            assert response.content == chunk_bytes(source, v1, big, index)
    assert len(proxy.served) == origin_reads  # nothing fetched again
    assert metric(url_of, "weightship_cache_hits_total") == count
    assert metric(url_of, fetches("origin")) == 0


async def test_a_cache_whose_upstream_is_down_reads_from_the_origin(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    caches: list[AgentProcess],
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    source = make_model("m1", tensors_mb=0.25, seed=23)
    v1: Manifest = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache", ["--upstream", "http://127.0.0.1:9", "--read-ahead", "0"])
    caches.append(cache)
    url_of = await running(cache)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    big = largest_file(v1)
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(chunk_request(url_of, v1, big, 0)[0], headers=auth)
    assert response.status_code == 200, response.text
    assert response.content == chunk_bytes(source, v1, big, 0)
    assert metric(url_of, fetches("origin")) == 1
    assert "cache.upstream_failed" in cache.log()


async def test_a_cache_reads_a_version_ahead_once_after_its_first_request(
    tmp_path: Path,
    fleet: Fleet,
    proxy: FaultProxy,
    caches: list[AgentProcess],
    model: str,
    deployment: str,
    make_model: Callable[..., Path],
) -> None:
    source = make_model("m1", tensors_mb=0.5, seed=24)
    v1 = fleet.publish(source, model, "v1")
    fleet.point(deployment, model, "v1")
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache", ["--read-ahead", "2"])
    caches.append(cache)
    url_of = await running(cache)
    auth = {"Authorization": "Ticket " + ticket(fleet, f"{model}-holder", [deployment], [v1.digest])}
    distinct = {digest for entry in v1.files for digest in entry.chunks}
    assert len(distinct) > 4, "the test needs a version of several chunks"
    proxy.served = []
    async with httpx.AsyncClient(timeout=30) as http:
        first = await http.get(chunk_request(url_of, v1, 0, 0)[0], headers=auth)
    assert first.status_code == 200, first.text
    # One request, and the whole version arrives: nobody asked for the other chunks.
    await eventually(
        lambda: metric(url_of, "weightship_cache_chunks") == len(distinct), 60, "the cache to read the version ahead"
    )
    # Every chunk's bytes from the origin exactly once, in range reads over runs of chunks (not one per chunk).
    read = sorted((s.blob, s.start, s.end) for s in proxy.served)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(read)), f"overlapping reads: {read}"
    assert sum(end - start for _b, start, end in read) == sum(entry.size for entry in v1.files)
    assert len(read) < len(distinct)
    served = len(proxy.served)
    async with httpx.AsyncClient(timeout=30) as http:
        for number, entry in enumerate(v1.files):
            for index in range(len(entry.chunks)):
                response = await http.get(chunk_request(url_of, v1, number, index)[0], headers=auth)
                assert response.content == chunk_bytes(source, v1, number, index)
    assert len(proxy.served) == served  # all hits now
    assert "cache.read_ahead_done" in cache.log()
