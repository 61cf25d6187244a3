"""Sources in order against real HTTP parts: a poisoned peer is rejected, reported, avoided; the fetch completes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from agent.chunkorder import chunk_order
from agent.counters import Counters
from agent.fetcher import Fetcher
from agent.rangeclient import RangeClient
from agent.sources import Sources
from agent.staging import Staging
from agent.tracker import NodeView, Tracker, TrackerSettings
from tests.agent.origin_urls import URLs
from tests.agent.tracker_parts import Signer, chunk_server, serve, tracker_server
from weightship.testing import Origin

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def origin(tmp_path: Path) -> AsyncIterator[Origin]:
    server = Origin(tmp_path / "origin")
    await server.start()
    yield server
    await server.stop()


async def test_poisoned_peer_is_rejected_reported_avoided_and_the_fetch_completes_from_others(
    tmp_path: Path, origin: Origin, make_model: Callable[..., Path]
) -> None:
    model = make_model("a", tensors_mb=2.0)
    manifest = origin.publish(model, "m")
    everything = list(range(len(chunk_order(manifest))))
    signer = Signer()
    tracker = Tracker(TrackerSettings(report_quorum=1))
    runners = []
    try:
        bad_app, bad_served = chunk_server(model, manifest, poison=True)
        good_app, good_served = chunk_server(model, manifest)
        bad_runner, bad_url = await serve(bad_app)
        good_runner, good_url = await serve(good_app)
        track_runner, track_url = await tracker_server(tracker, signer, {manifest.digest: manifest})
        runners = [bad_runner, good_runner, track_runner]
        # the poisoned peer claims the most spare capacity, so it is ranked first
        tracker.announce(NodeView("poison", bad_url, upload_slots_free=50), {manifest.digest: everything})
        tracker.announce(NodeView("honest", good_url, upload_slots_free=1), {manifest.digest: everything})

        async def tickets(versions: list[str], audience: str | None = None) -> str:
            return signer.sign("me", versions)

        sources = Sources(node="me", address="http://127.0.0.1:1", labels={}, tickets=tickets, tracker=track_url,
                          announce_debounce=0.01)  # fmt: skip
        sources.holding(manifest)
        announcing = asyncio.get_running_loop().create_task(sources.announce_loop())
        counters = Counters()
        client = RangeClient()
        staging = Staging(tmp_path / "staging", manifest)
        staging.open()
        fetcher = Fetcher(client, URLs(origin.url), counters, ThreadPoolExecutor(2), concurrency=1,
                          attempts=2, backoff_initial=0.01, backoff_max=0.02, sources=sources)  # fmt: skip
        try:
            await fetcher.fetch(staging, {})
        finally:
            announcing.cancel()
            await client.close()
            await sources.close()
        assert staging.jobs() == []  # every chunk verified and placed
        tally = counters.snapshot().sources
        assert len(bad_served) == 1  # one bad chunk, then the poisoned peer is never asked again
        assert tally["peer"].errors == 1
        assert counters.chunks_rejected == 1
        # the rest came from the honest peer, or (while it was at its fan-out bound) from the origin
        assert tally["peer"].chunks == len(good_served) >= 1
        assert tally["peer"].chunks + tally["origin"].chunks == len(everything)
        assert tracker.avoided("poison", "me")
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_slow_parent_is_cut_off_reported_and_replaced(
    tmp_path: Path, origin: Origin, make_model: Callable[..., Path]
) -> None:
    model = make_model("s", tensors_mb=0.5)
    manifest = origin.publish(model, "m")
    everything = list(range(len(chunk_order(manifest))))
    signer = Signer()
    tracker = Tracker(TrackerSettings(report_quorum=1))
    stalled: list[str] = []
    release = asyncio.Event()

    async def trickle(request: web.Request) -> web.StreamResponse:
        stalled.append(request.match_info["chunk"])
        response = web.StreamResponse(headers={"Content-Length": str(1 << 20)})
        await response.prepare(request)
        await response.write(b"x")
        await release.wait()  # the fault: a parent that stops sending until the test ends
        return response

    slow_app = web.Application()
    slow_app.router.add_get("/v1/chunks/{chunk}", trickle)
    good_app, good_served = chunk_server(model, manifest)
    runners = [await serve(slow_app), await serve(good_app)]
    track_runner, track_url = await tracker_server(tracker, signer, {manifest.digest: manifest})
    runners.append((track_runner, track_url))
    try:
        tracker.announce(NodeView("slow", runners[0][1], upload_slots_free=50), {manifest.digest: everything})
        tracker.announce(NodeView("honest", runners[1][1], upload_slots_free=50), {manifest.digest: everything})

        async def tickets(versions: list[str], audience: str | None = None) -> str:
            return signer.sign("me", versions)

        # 0.3 s allowance and a rate no chunk from the stalled parent can meet
        sources = Sources(node="me", address="http://127.0.0.1:1", labels={}, tickets=tickets, tracker=track_url,
                          slow_floor=0.3, peer_min_rate=1e9, announce_debounce=0.01)  # fmt: skip
        sources.holding(manifest)
        announcing = asyncio.get_running_loop().create_task(sources.announce_loop())
        counters = Counters()
        client = RangeClient()
        staging = Staging(tmp_path / "staging", manifest)
        staging.open()
        fetcher = Fetcher(client, URLs(origin.url), counters, ThreadPoolExecutor(2), concurrency=1,
                          attempts=2, backoff_initial=0.01, backoff_max=0.02, sources=sources)  # fmt: skip
        try:
            await asyncio.wait_for(fetcher.fetch(staging, {}), 30)
        finally:
            announcing.cancel()
            await client.close()
            await sources.close()
        assert staging.jobs() == []
        assert len(stalled) == 1  # cut off once, then never chosen again by this node
        assert counters.snapshot().sources["peer"].errors == 1
        assert tracker.avoided("slow", "me")
        assert len(good_served) >= 1
    finally:
        release.set()
        for runner, _url in runners:
            await runner.cleanup()


async def test_with_the_tracker_and_cache_down_a_node_falls_back_up_the_tiers_to_the_origin(
    tmp_path: Path, origin: Origin, make_model: Callable[..., Path]
) -> None:
    manifest = origin.publish(make_model("d", tensors_mb=0.5), "m")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    signer = Signer()

    async def tickets(versions: list[str], audience: str | None = None) -> str:
        return signer.sign("me", versions)

    sources = Sources(node="me", address="", labels={}, tickets=tickets, tracker=dead, cluster_cache=dead)
    counters = Counters()
    client = RangeClient()
    staging = Staging(tmp_path / "staging", manifest)
    staging.open()
    fetcher = Fetcher(client, URLs(origin.url), counters, ThreadPoolExecutor(2), concurrency=2,
                      attempts=2, backoff_initial=0.01, backoff_max=0.02, sources=sources)  # fmt: skip
    try:
        await asyncio.wait_for(fetcher.fetch(staging, {}), 30)
    finally:
        await client.close()
        await sources.close()
    assert staging.jobs() == []
    tally = counters.snapshot().sources
    chunks = len(chunk_order(manifest))
    assert tally["origin"].chunks == chunks
    assert tally["cluster_cache"].errors == chunks  # each chunk tried the cache first
    assert tally["peer"].errors == 0


async def test_a_busy_cache_is_waited_for_instead_of_sending_the_chunk_to_the_origin(
    tmp_path: Path, origin: Origin, make_model: Callable[..., Path]
) -> None:
    model = make_model("e", tensors_mb=0.5)
    manifest = origin.publish(model, "m")
    app, served = chunk_server(model, manifest, busy_first=2)
    runner, cache_url = await serve(app)
    signer = Signer()

    async def tickets(versions: list[str], audience: str | None = None) -> str:
        return signer.sign("me", versions)

    sources = Sources(node="me", address="", labels={}, tickets=tickets, cluster_cache=cache_url)
    counters = Counters()
    client = RangeClient()
    staging = Staging(tmp_path / "staging", manifest)
    staging.open()
    fetcher = Fetcher(client, URLs(origin.url), counters, ThreadPoolExecutor(2), concurrency=2,
                      attempts=2, backoff_initial=0.01, backoff_max=0.02, sources=sources)  # fmt: skip
    try:
        await asyncio.wait_for(fetcher.fetch(staging, {}), 30)
    finally:
        await client.close()
        await sources.close()
        await runner.cleanup()
    assert staging.jobs() == []
    tally = counters.snapshot().sources
    chunks = len(chunk_order(manifest))
    assert tally["origin"].chunks == 0  # a refusal for load is waited out, never escalated
    assert tally["cluster_cache"].chunks == chunks
    assert tally["cluster_cache"].errors == 2 * chunks
    assert sorted(served) == sorted(chunk_order(manifest))
