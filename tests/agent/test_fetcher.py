"""The fetcher against real HTTP origins: expired URLs refreshed, bad origins rejected, local copies preferred."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from agent.counters import Counters
from agent.durability import is_unsynced, make_durable
from agent.fetcher import Fetcher
from agent.rangeclient import RangeClient
from agent.staging import Staging
from agent.store import VersionStore
from tests.agent.local_versions import install
from tests.agent.origin_urls import URLs
from weightship.errors import IntegrityError, StoreError
from weightship.testing import Origin

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def origin(tmp_path: Path) -> AsyncIterator[Origin]:
    """A blob origin with range requests on a loopback port (S3 behind presigned URLs)."""
    server = Origin(tmp_path / "origin")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def session() -> AsyncIterator[RangeClient]:
    client = RangeClient()
    yield client
    await client.close()


@pytest.fixture
def executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(2)


def fetcher(session: RangeClient, urls: URLs, counters: Counters, executor: ThreadPoolExecutor) -> Fetcher:
    return Fetcher(session, urls, counters, executor, concurrency=4, attempts=3, backoff_initial=0.01, backoff_max=0.05)


async def test_an_expired_url_is_refreshed_and_the_fetch_completes(
    tmp_path: Path,
    origin: Origin,
    make_model: Callable[..., Path],
    session: RangeClient,
    executor: ThreadPoolExecutor,
) -> None:
    manifest = origin.publish(make_model("a"), "m")
    staging = Staging(tmp_path, manifest)
    staging.open()
    urls = URLs(origin.url, expired=1)
    counters = Counters()
    await fetcher(session, urls, counters, executor).fetch(staging, {})
    assert staging.jobs() == []
    assert urls.requests >= 2
    assert counters.bytes_downloaded == manifest.total_size


async def test_chunks_held_locally_are_copied_not_downloaded(
    tmp_path: Path,
    origin: Origin,
    make_model: Callable[..., Path],
    session: RangeClient,
    executor: ThreadPoolExecutor,
) -> None:
    source = make_model("a")
    manifest = origin.publish(source, "m")
    store = VersionStore(tmp_path / "data")
    install(store, source, "other-model")  # same files, another version (different model name)
    staging = Staging(store.staging_dir, manifest)
    staging.open()
    counters = Counters()
    await fetcher(session, URLs(origin.url), counters, executor).fetch(staging, store.local_chunks())
    assert staging.jobs() == []
    assert origin.served == []
    assert counters.bytes_downloaded == 0
    assert counters.bytes_copied_locally == manifest.total_size


async def _bad_origin(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/blobs/{sha}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        ("ignores-range", StoreError),  # answers 200 with the whole multi-chunk blob
        ("sends-too-much", IntegrityError),  # 206 with more bytes than asked for
    ],
)
async def test_a_misbehaving_origin_fails_the_fetch_with_a_clear_error(
    tmp_path: Path,
    origin: Origin,
    make_model: Callable[..., Path],
    session: RangeClient,
    executor: ThreadPoolExecutor,
    behaviour: str,
    error: type[Exception],
) -> None:
    manifest = origin.publish(make_model("a", tensors_mb=0.5), "m")

    async def handler(request: web.Request) -> web.Response:
        data = (origin.blobs / request.match_info["sha"]).read_bytes()
        if behaviour == "ignores-range":
            return web.Response(body=data)
        first, last = request.headers["Range"].removeprefix("bytes=").split("-")
        body = data[int(first) : int(last) + 1] + b"extra"
        return web.Response(status=206, body=body, headers={"Content-Range": f"bytes {first}-{last}/{len(data)}"})

    runner, url = await _bad_origin(handler)
    try:
        staging = Staging(tmp_path, manifest)
        staging.open()
        with pytest.raises(error, match="failed 3 times"):
            await fetcher(session, URLs(url), Counters(), executor).fetch(staging, {})
        # Only a one-chunk file (config.json, whose whole blob is the chunk) may have been accepted.
        assert all(manifest.files[f].size <= manifest.chunk_size for f, _c in staging.done)
    finally:
        await runner.cleanup()


async def test_a_fetch_leaves_the_staging_area_marked_unsynced_until_it_is_flushed(
    tmp_path: Path,
    origin: Origin,
    make_model: Callable[..., Path],
    session: RangeClient,
    executor: ThreadPoolExecutor,
) -> None:
    """Nothing is fsynced while chunks land: the marker says so until ``make_durable`` (``agent.durability``)."""
    manifest = origin.publish(make_model("a"), "m")
    staging = Staging(tmp_path, manifest)
    staging.open()
    await fetcher(session, URLs(origin.url), Counters(), executor).fetch(staging, {})
    assert is_unsynced(staging.dir)
    staging.finish(sync=False)
    assert is_unsynced(staging.dir)
    make_durable(staging.dir)
    assert not is_unsynced(staging.dir)
