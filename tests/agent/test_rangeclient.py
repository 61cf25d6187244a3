"""The blob transport: range reads into buffers, keep-alive, TLS, and every way an origin can misbehave."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from agent.rangeclient import HttpAnswer, RangeClient, UrlRejected
from weightship.errors import IntegrityError, StoreError, TemporaryError

pytestmark = pytest.mark.timeout(30)

BLOB = bytes(range(256)) * 4096  # 1 MiB
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CONNECTIONS = web.AppKey("connections", set[int])


async def ranged(request: web.Request) -> web.StreamResponse:
    """A well-behaved origin."""
    first, last = request.headers["Range"].removeprefix("bytes=").split("-")
    start, end = int(first), int(last) + 1
    request.app[CONNECTIONS].add(id(request.transport))
    return web.Response(
        status=206, body=BLOB[start:end], headers={"Content-Range": f"bytes {start}-{end - 1}/{len(BLOB)}"}
    )


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    runners: list[web.AppRunner] = []
    apps: list[web.Application] = []

    async def start(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> str:
        app = web.Application()
        app[CONNECTIONS] = set()
        app.router.add_get("/blob", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        runners.append(runner)
        apps.append(app)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}/blob?sig=secret"

    start.apps = apps  # type: ignore[attr-defined]
    yield start
    for runner in runners:
        await runner.cleanup()


async def read(client: RangeClient, url: str, start: int, length: int) -> tuple[bytes, int]:
    buf = bytearray(length)
    counted: list[int] = []
    await client.get_range(url, start, memoryview(buf), counted.append)
    return bytes(buf), sum(counted)


async def test_ranges_land_in_the_buffer_over_one_kept_alive_connection(serve: Callable[..., Awaitable[str]]) -> None:
    url = await serve(ranged)
    client = RangeClient()
    for start in (0, 65536, 999_000):
        data, counted = await read(client, url, start, 4096)
        assert data == BLOB[start : start + 4096]
        assert counted == 4096
    assert len(serve.apps[0][CONNECTIONS]) == 1  # type: ignore[attr-defined]
    await client.close()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: (key, cert)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


async def test_tls_origins_work_like_presigned_s3_urls(
    serve: Callable[..., Awaitable[str]], certificate: tuple[Path, Path]
) -> None:
    key, cert = certificate
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    url = await serve(ranged, server_ctx)
    client = RangeClient(ssl_context=ssl.create_default_context(cafile=str(cert)))
    data, _ = await read(client, url, 100_000, 300_000)
    assert data == BLOB[100_000:400_000]
    await client.close()
    with pytest.raises(TemporaryError, match="cannot connect"):
        await read(RangeClient(), url, 0, 10)  # not trusted without the certificate


async def respond(status: int, body: bytes = b"", **headers: str) -> Handler:
    async def handler(_request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers)

    return handler


@pytest.mark.parametrize(
    ("status", "headers", "body", "error", "message"),
    [
        (403, {}, b"expired", UrlRejected, "expired or was revoked"),
        (503, {}, b"busy", TemporaryError, "answered 503"),
        (206, {"Content-Range": "bytes 0-99/1000"}, b"x" * 100, StoreError, "asked for bytes 0-9/"),
        (200, {}, b"x" * 1000, StoreError, "ignored the Range header"),
        (206, {"Content-Range": "bytes 0-9/1000"}, b"x" * 20, IntegrityError, "refused unread"),
        (206, {"Content-Range": "bytes 0-9/1000"}, b"x" * 5, StoreError, "5 of the 10 bytes"),
        (302, {"Location": "http://elsewhere/"}, b"", StoreError, "answered 302"),
    ],
)
async def test_origin_answers_that_break_the_contract_are_clear_errors(
    serve: Callable[..., Awaitable[str]],
    status: int,
    headers: dict[str, str],
    body: bytes,
    error: type[Exception],
    message: str,
) -> None:
    url = await serve(await respond(status, body, **headers))
    with pytest.raises(error, match=message) as caught:
        await read(RangeClient(), url, 0, 10)
    assert "secret" not in str(caught.value), "a signed URL's query must never appear in errors"


async def test_chunked_bodies_are_refused(serve: Callable[..., Awaitable[str]]) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=206, headers={"Content-Range": "bytes 0-9/1000"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"x" * 10)
        await resp.write_eof()
        return resp

    with pytest.raises(StoreError, match="chunked"):
        await read(RangeClient(), await serve(chunked), 0, 10)


async def test_a_connection_cut_mid_body_counts_what_arrived(serve: Callable[..., Awaitable[str]]) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=206, headers={"Content-Range": "bytes 0-99999/1000000", "Content-Length": "100000"}
        )
        await resp.prepare(request)
        await resp.write(b"y" * 30000)
        assert request.transport is not None
        request.transport.close()
        return resp

    counted: list[int] = []
    with pytest.raises(TemporaryError, match="closed the connection"):
        await RangeClient().get_range(await serve(cut), 0, memoryview(bytearray(100000)), counted.append)
    assert 0 < sum(counted) <= 30000


async def test_an_origin_that_stalls_times_out(serve: Callable[..., Awaitable[str]]) -> None:
    stall = asyncio.Event()

    async def stalled(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=206, headers={"Content-Range": "bytes 0-9/1000", "Content-Length": "10"})
        await resp.prepare(request)
        await stall.wait()
        return resp

    with pytest.raises(TemporaryError, match="sent nothing for"):
        await read(RangeClient(read_timeout=0.3), await serve(stalled), 0, 10)
    stall.set()


# --- whole-body GETs (peers and caches: GET /v1/chunks/...) -------------------------------------


async def test_a_whole_body_lands_in_the_buffer_with_the_headers_asked_for(serve: Callable[..., Awaitable[str]]) -> None:
    seen: list[str] = []

    async def chunk(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        request.app[CONNECTIONS].add(id(request.transport))
        return web.Response(body=BLOB[:300_000])

    url = await serve(chunk)
    client = RangeClient()
    for _ in range(3):
        buf = bytearray(300_000)
        counted: list[int] = []
        await client.get(url, memoryview(buf), counted.append, {"Authorization": "Ticket t0k"})
        assert bytes(buf) == BLOB[:300_000]
        assert sum(counted) == 300_000
    assert seen == ["Ticket t0k"] * 3
    assert len(serve.apps[0][CONNECTIONS]) == 1  # type: ignore[attr-defined]
    await client.close()


@pytest.mark.parametrize("size", [5_000, 700_000], ids=["under_the_wake_size", "over_it"])
async def test_a_body_that_trickles_in_completes(serve: Callable[..., Awaitable[str]], size: int) -> None:
    """The reader asks to be woken only once many bytes are queued; the last, smaller part must still wake it."""

    async def trickle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = size
        await resp.prepare(request)
        for start in range(0, size, 3_000):
            await resp.write(BLOB[start : min(size, start + 3_000)])
            await asyncio.sleep(0.002 if start % 60_000 == 0 else 0)
        return resp

    url = await serve(trickle)
    client = RangeClient()
    for _ in range(2):  # the second read proves the connection was left waking at every byte again
        buf = bytearray(size)
        await asyncio.wait_for(client.get(url, memoryview(buf), lambda _n: None), 10)
        assert bytes(buf) == BLOB[:size]
    await client.close()


@pytest.mark.parametrize(
    ("status", "body", "error", "message"),
    [
        (200, b"x" * 20, IntegrityError, "refused unread"),
        (200, b"x" * 5, TemporaryError, "5 of the 10 bytes"),
    ],
    ids=["longer", "shorter"],
)
async def test_a_body_of_the_wrong_length_is_refused_unread(
    serve: Callable[..., Awaitable[str]], status: int, body: bytes, error: type[Exception], message: str
) -> None:
    url = await serve(await respond(status, body))
    with pytest.raises(error, match=message):
        await RangeClient().get(url, memoryview(bytearray(10)), lambda _n: None)


async def test_a_refusal_comes_back_with_its_status_and_body(serve: Callable[..., Awaitable[str]]) -> None:
    problem = b'{"title": "busy", "detail": "16 uploads already"}'
    url = await serve(await respond(503, problem, **{"Content-Type": "application/problem+json", "Retry-After": "1"}))
    client = RangeClient()
    with pytest.raises(HttpAnswer) as caught:
        await client.get(url, memoryview(bytearray(10)), lambda _n: None)
    assert caught.value.status == 503
    assert caught.value.body == problem
    assert caught.value.headers["retry-after"] == "1"
    assert "secret" not in str(caught.value)
    await client.close()
