"""The peer listener under a hostile client: bad parameters, clients that never read, idle connection floods.

Threats: anyone who reaches a node's peer port (no ticket needed to connect) holds every upload
slot with clients that never read, or opens connections until the agent runs out of file
descriptors, so that chunk requests, the local API and the control-plane client all fail, and the
agent logs without bound. Real control plane and agent processes; the flooded agent runs with a
1,024 file-descriptor limit (``prlimit``), as many hosts set by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from agent.listenerbounds import ListenerBounds
from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import chunk_request, largest_file, metric, peer_url, ticket
from weightship.manifest import Manifest, parse_manifest
from weightship.testing import problem

pytestmark = pytest.mark.timeout(240)

#: the agent's default send timeout (``PeerServer(send_timeout=...)``)
SEND_TIMEOUT = 10.0


async def test_a_chunk_index_that_is_not_ascii_digits_is_a_400_not_a_500(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.25, seed=21), model, "v1")
    fleet.point(deployment, model, "v1")
    node = spawn(f"{model[:60]}-node", extra=["--peer-listen", "127.0.0.1:0"])
    await node.ready()
    await node.serving(v1.digest)
    genuine = ticket(fleet, f"{model[:60]}-asker", [deployment], [v1.digest])
    url, _chunk = chunk_request(peer_url(node), v1)
    headers = {"Authorization": f"Ticket {genuine}"}
    async with httpx.AsyncClient(timeout=10) as http:
        for index in ("²", "١", "0x1", "-1", "1" * 40):
            response = await http.get(url.replace("index=0", f"index={index}"), headers=headers)
            assert response.status_code == 400, (index, response.text)
            assert problem(response)["code"] == "invalid"
        # a GET with a body is refused before any handler reads it
        response = await http.request("GET", url, headers=headers, content=b"x" * 4096)
        assert response.status_code == 413
        assert (await http.get(url, headers=headers)).status_code == 200


def _publish_big_chunks(fleet: Fleet, model_dir: Path, model: str, label: str, chunk_size: int) -> Manifest:
    with fleet.cp.client() as admin:
        version = admin.publish_directory(model_dir, model, [label], chunk_size=chunk_size).version
        return parse_manifest(admin.get_manifest(model, version.digest))


def _stalled_client(url: str, token: str) -> socket.socket:
    """A client that sends a chunk request and never reads the answer (a tiny receive window)."""
    parts = httpx.URL(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.host, parts.port or 80))
    target = parts.raw_path.decode()
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {parts.host}\r\nAuthorization: Ticket {token}\r\n\r\n".encode())
    return sock


async def test_clients_that_never_read_free_their_upload_slots_after_the_send_timeout(
    fleet: Fleet, spawn: Spawn, model: str, deployment: str, make_model: Callable[..., Path]
) -> None:
    # 16 MiB chunks: more than the kernel buffers of a connection whose client never reads
    v1 = _publish_big_chunks(fleet, make_model("big", tensors_mb=48, seed=22), model, "v1", 16 << 20)
    fleet.point(deployment, model, "v1")
    node = spawn(f"{model[:60]}-node", extra=["--peer-listen", "127.0.0.1:0", "--upload-concurrency", "4"])
    await node.ready()
    await node.serving(v1.digest, within=120)
    genuine = ticket(fleet, f"{model[:60]}-asker", [deployment], [v1.digest])
    file = largest_file(v1)
    url, _chunk = chunk_request(peer_url(node), v1, file=file, index=0)
    stalled = [_stalled_client(url, genuine) for _ in range(4)]
    try:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as http:
            refused = 0
            while True:
                response = await http.get(url, headers={"Authorization": f"Ticket {genuine}"})
                if response.status_code == 200:
                    break
                assert response.status_code == 503, response.text
                refused += 1
                assert time.monotonic() - started < SEND_TIMEOUT + 10, "upload slots still held past the send timeout"
                await asyncio.sleep(0.25)  # ok-sleep: deliberate pacing, not a wait for a condition
        waited = time.monotonic() - started
        print(f"4 clients that never read: a normal GET answered 200 after {waited:.1f}s ({refused} x 503 before)")
        assert refused > 0, "the stalled clients never held the slots: the test did not test anything"
        assert waited < SEND_TIMEOUT + 10
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(f"{peer_url(node)}/metrics")).text
        assert 'weightship_peer_refused_total{reason="send_timeout"} 4' in metrics
    finally:
        for sock in stalled:
            sock.close()


@pytest.fixture
def many_fds() -> Iterator[None]:
    """This test process may open 1,100+ sockets (its soft fd limit raised to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 1300:
        pytest.skip(f"this process may open only {hard} files; the flood needs about 1,300")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class _LimitedAgent(AgentProcess):
    """An agent process started with a 1,024 file-descriptor limit."""

    def argv(self) -> list[str]:
        return ["prlimit", "--nofile=1024:1024", "--", *super().argv()]


def _flood(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections that never send a byte."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect((host, port))
        socks.append(sock)
    return socks


async def test_an_idle_connection_flood_leaves_the_local_api_and_chunk_requests_answering(
    tmp_path: Path, fleet: Fleet, model: str, deployment: str, make_model: Callable[..., Path], many_fds: None
) -> None:
    v1 = fleet.publish(make_model("m1", tensors_mb=0.25, seed=23), model, "v1")
    fleet.point(deployment, model, "v1")
    node = _LimitedAgent(tmp_path / "agents", f"{model[:60]}-node", fleet.cp.url, fleet.agent_token, [deployment],
                         ["--peer-listen", "127.0.0.1:0"])  # fmt: skip
    node.data_dir.parent.mkdir(parents=True, exist_ok=True)
    node.start()
    socks: list[socket.socket] = []
    try:
        await node.ready()
        await node.serving(v1.digest)
        genuine = ticket(fleet, f"{model[:60]}-asker", [deployment], [v1.digest])
        base = peer_url(node)
        url, _chunk = chunk_request(base, v1)
        lines_before = len(node.log().splitlines())
        parts = httpx.URL(base)
        socks = _flood(parts.host, parts.port or 80, 1100)
        # the flood filled the listener to its cap: from here on each new connection closes an idle one
        await eventually(lambda: metric(base, 'weightship_peer_connections_closed_total{reason="evicted"}') > 0,
                         60, "the flood to reach the connection cap")  # fmt: skip
        async with httpx.AsyncClient(timeout=10) as http:
            started = time.monotonic()
            status = await http.get(node.url + "/local/v1/status")
            api_s = time.monotonic() - started
            started = time.monotonic()
            chunk = await http.get(url, headers={"Authorization": f"Ticket {genuine}"})
            get_s = time.monotonic() - started
            metrics = (await http.get(f"{base}/metrics")).text
        assert status.status_code == 200
        assert chunk.status_code == 200, chunk.text
        connections = next(int(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("weightship_peer_connections "))  # fmt: skip
        lines = len(node.log().splitlines()) - lines_before
        print(f"1,100 idle connections at a 1,024-fd agent: local API {api_s * 1000:.0f} ms, chunk GET "
              f"{get_s * 1000:.0f} ms, {connections} connections held, {lines} log lines")  # fmt: skip
        assert connections < 1024
        assert "Too many open files" not in node.log()
        assert lines < 50, node.log()[-3000:]
    finally:
        for sock in socks:
            sock.close()
        await node.close()



@contextlib.asynccontextmanager
async def _bounded(bounds: ListenerBounds, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    """A listener with ``bounds`` serving ``handler`` at ``/``; yields its port."""
    app = web.Application(middlewares=[bounds.middleware])
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    assert runner.server is not None
    bounds.serve(sock, runner.server)
    try:
        yield port
    finally:
        await bounds.stop()
        await runner.cleanup()


async def _closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    async with asyncio.timeout(within):
        return await reader.read() == b""


async def test_a_connection_that_never_finishes_its_request_head_is_closed_after_the_idle_timeout() -> None:
    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    bounds = ListenerBounds("test", logging.getLogger("tests.bounds"), max_connections=8, idle_timeout=0.3)
    async with _bounded(bounds, ok) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # half a head, and then nothing (slowloris)
        await writer.drain()
        started = time.monotonic()
        assert await _closed_by_server(reader, 5.0)
        assert time.monotonic() - started < 2.0
        writer.close()
        await writer.wait_closed()


async def test_at_the_connection_cap_the_idlest_connection_makes_room_and_busy_ones_are_kept() -> None:
    release = asyncio.Event()
    waiting: list[str] = []

    async def slow(request: web.Request) -> web.Response:
        if request.query.get("wait"):
            waiting.append(request.query["wait"])
            await release.wait()
        return web.Response(text="ok")

    bounds = ListenerBounds("test", logging.getLogger("tests.bounds"), max_connections=2, idle_timeout=30)
    async with _bounded(bounds, slow) as port, httpx.AsyncClient(timeout=5) as http:
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        busy = asyncio.create_task(http.get(f"http://127.0.0.1:{port}/", params={"wait": "1"}))
        await eventually(lambda: len(waiting) == 1 and bounds.connections() == 2, 5, "an idle and a busy connection")
        # a third: the idle one is closed to make room, the busy one is kept
        async with httpx.AsyncClient(timeout=5) as other:
            assert (await other.get(f"http://127.0.0.1:{port}/")).status_code == 200
        assert await _closed_by_server(idle_reader, 5.0)
        assert bounds.evicted == 1
        # every connection busy: a new one is answered 503 and closed
        async with httpx.AsyncClient(timeout=5) as third:
            blocker = asyncio.create_task(third.get(f"http://127.0.0.1:{port}/", params={"wait": "2"}))
            await eventually(lambda: len(waiting) == 2 and bounds.connections() == 2, 5, "two busy connections")
            async with httpx.AsyncClient(timeout=5) as refused:
                assert (await refused.get(f"http://127.0.0.1:{port}/")).status_code == 503
            release.set()
            assert (await blocker).status_code == 200
        assert (await busy).status_code == 200
        idle_writer.close()
        await idle_writer.wait_closed()
