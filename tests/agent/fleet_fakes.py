"""Stand-ins for the agent's outside world, served over real HTTP in the test process.

- ``Origin``: a blob store with HTTP range requests (like S3 behind presigned URLs); it records
  every range it served and can be slowed down.
- ``FaultProxy``: forwards blob reads to an origin and corrupts the responses a rule selects.
- ``FakeControlPlane``: the node-side routes of the control plane (register, heartbeat,
  desired-state long-poll, blob URLs, manifests) over the ``weightship.schemas`` contract, with
  pointers the test sets directly, including stale epochs a real control plane would never write.

The real control plane is exercised by ``test_controlplane_integration.py``; these fakes let
the fault tests control exactly what the agent sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
from aiohttp import web

from weightship.digests import sha256_hex
from weightship.manifest import Manifest, build_manifest
from weightship.schemas import (
    BlobURL,
    BlobURLRequest,
    BlobURLs,
    DesiredDeployment,
    DesiredState,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
)

AGENT_TOKEN = "ws_fake-agent-token"
TEST_CHUNK = 64 * 1024


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
    await site.start()
    server = site._server
    assert server is not None
    return runner, int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


def _parse_range(header: str, size: int) -> tuple[int, int]:
    spec = header.removeprefix("bytes=")
    first, _, last = spec.partition("-")
    return int(first), min(int(last), size - 1) + 1


@dataclass
class Served:
    """One range request the origin answered."""

    blob: str
    start: int
    end: int
    complete: bool = False


class Origin:
    """Blobs by sha256 over HTTP with range requests; records what it served."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.manifests: dict[str, bytes] = {}
        self.served: list[Served] = []
        #: seconds to wait before answering each request
        self.delay = 0.0
        #: answer this many range requests, then hold every further one until ``release()``
        self.hold_after: int | None = None
        self._released = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    def publish(self, model_dir: Path, model: str, chunk_size: int = TEST_CHUNK) -> Manifest:
        """Put a model directory's files in the origin; returns its manifest."""
        manifest = build_manifest(model_dir, model, chunk_size=chunk_size)
        for entry in manifest.files:
            target = self.blobs / entry.sha256
            if not target.exists():
                shutil.copyfile(model_dir / entry.path, target)
        self.manifests[manifest.digest] = manifest.raw
        return manifest

    def held(self) -> int:
        """Requests waiting for ``release()`` right now."""
        if self.hold_after is None or self._released.is_set():
            return 0
        return sum(1 for s in self.served[self.hold_after :] if not s.complete)

    def release(self) -> None:
        """Answer the held requests and stop holding."""
        self.hold_after = None
        self._released.set()
        self._released = asyncio.Event()

    def bytes_served(self, complete_only: bool = True) -> int:
        """Bytes of range responses sent in full."""
        return sum(s.end - s.start for s in self.served if s.complete or not complete_only)

    async def start(self) -> None:
        """Listen on a free loopback port."""
        app = web.Application()
        app.router.add_get("/blobs/{sha}", self._blob)
        self._runner, port = await _serve(app)
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha"]
        expires = float(request.query.get("expires", "inf"))
        if expires < time.time():
            return web.Response(status=403, text="URL expired")
        path = self.blobs / sha
        if not path.exists():
            return web.Response(status=404)
        data = path.read_bytes()
        start, end = _parse_range(request.headers.get("Range", f"bytes=0-{len(data) - 1}"), len(data))
        record = Served(sha, start, end)
        self.served.append(record)
        if self.hold_after is not None and len(self.served) > self.hold_after:
            await self._released.wait()
        if self.delay:
            await asyncio.sleep(self.delay)  # ok-sleep: a deliberately slow origin
        resp = web.StreamResponse(
            status=206,
            headers={"Content-Range": f"bytes {start}-{end - 1}/{len(data)}", "Content-Length": str(end - start)},
        )
        await resp.prepare(request)
        await resp.write(data[start:end])
        await resp.write_eof()
        record.complete = True
        return resp


@dataclass
class FaultProxy:
    """Forwards ``/blobs/...`` to an upstream origin; ``corrupt(blob, start)`` picks responses to damage."""

    upstream: str
    corrupt: Callable[[str, int], bool] = lambda _blob, _start: False
    corrupted: list[tuple[str, int]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Listen on a free loopback port."""
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_get("/blobs/{sha}", self._forward)
        self._runner, port = await _serve(app)
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        sha = request.match_info["sha"]
        headers = {k: v for k, v in request.headers.items() if k in ("Range",)}
        async with self._session.get(f"{self.upstream}{request.rel_url}", headers=headers) as upstream:
            body = bytearray(await upstream.read())
            passed = {k: v for k, v in upstream.headers.items() if k in ("Content-Range",)}
            status = upstream.status
        start = int(request.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0])
        if status == 206 and body and self.corrupt(sha, start):
            body[len(body) // 2] ^= 0xFF  # one flipped byte: same length, wrong hash
            self.corrupted.append((sha, start))
        return web.Response(status=status, body=bytes(body), headers=passed)


@dataclass
class Pointer:
    """A deployment's serving pointer as the fake control plane holds it."""

    model: str
    stable: str | None
    epoch: int
    previous_stable: str | None = None
    canary: str | None = None


@dataclass
class FakeNode:
    """A registered node."""

    id: str
    name: str
    deployments: list[str]
    heartbeat: NodeHeartbeat | None = None
    heartbeats: int = 0


class FakeControlPlane:
    """The control plane as an agent sees it, with pointers set by the test."""

    def __init__(self, origin: Origin, *, blob_base: str | None = None, url_ttl: float = 3600.0) -> None:
        self.origin = origin
        #: where blob URLs point (the origin, or a fault proxy in front of it)
        self.blob_base = blob_base
        self.url_ttl = url_ttl
        self.pointers: dict[str, Pointer] = {}
        self.nodes: dict[str, FakeNode] = {}
        self.url_requests = 0
        self.port = 0
        self.url = ""
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    # --- test controls ----------------------------------------------------------------------------

    async def set_pointer(self, name: str, model: str, stable: str, canary: str | None = None) -> Pointer:
        """Move ``name`` to ``stable`` (and ``canary``) at the next epoch, like a real pointer update."""
        old = self.pointers.get(name)
        previous = old.stable if old and old.stable != stable else (old.previous_stable if old else None)
        pointer = Pointer(model, stable, (old.epoch if old else 0) + 1, previous, canary)
        await self._publish(name, pointer)
        return pointer

    async def force_pointer(self, name: str, pointer: Pointer) -> None:
        """Serve exactly ``pointer`` (any epoch), as a replayed or restored-from-backup state would."""
        await self._publish(name, pointer)

    async def _publish(self, name: str, pointer: Pointer) -> None:
        self.pointers[name] = pointer
        async with self._changed:
            self._changed.notify_all()

    def node(self, name: str) -> FakeNode | None:
        """The node registered as ``name``."""
        return next((n for n in self.nodes.values() if n.name == name), None)

    def desired(self, node: FakeNode) -> DesiredState:
        """What ``node`` should serve (canary when a canary is set: these tests use share 1.0)."""
        items = []
        for name in sorted(node.deployments):
            p = self.pointers.get(name)
            if p is None:
                continue
            keep = list(dict.fromkeys(d for d in (p.stable, p.previous_stable, p.canary) if d))
            items.append(
                DesiredDeployment(
                    name=name,
                    model=p.model,
                    digest=p.canary or p.stable,
                    epoch=p.epoch,
                    role="canary" if p.canary else "stable",
                    keep=keep,
                )
            )
        content = "|".join(i.model_dump_json() for i in items)
        return DesiredState(node_id=node.id, revision=sha256_hex(content.encode())[:32], deployments=items)

    # --- server ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (on the same port as before, after a ``stop``)."""
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/nodes/register", self._register)
        app.router.add_post("/v1/nodes/{id}/heartbeat", self._heartbeat)
        app.router.add_get("/v1/nodes/{id}/desired", self._desired)
        app.router.add_post("/v1/blobs/urls", self._urls)
        app.router.add_get("/v1/models/{model}/versions/{ref}/manifest", self._manifest)
        self._runner, self.port = await _serve(app, self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Stop listening (the control plane goes down; its state stays)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], object]) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {AGENT_TOKEN}":
            return web.json_response({"error": {"code": "unauthenticated", "message": "bad token"}}, status=401)
        result = await handler(request)  # type: ignore[misc]
        assert isinstance(result, web.StreamResponse)
        return result

    def _known(self, request: web.Request) -> FakeNode:
        node = self.nodes.get(request.match_info["id"])
        if node is None:
            raise web.HTTPNotFound(
                text='{"error": {"code": "not_found", "message": "node unknown"}}', content_type="application/json"
            )
        return node

    async def _register(self, request: web.Request) -> web.Response:
        body = NodeRegistration.model_validate_json(await request.read())
        node = self.node(body.name)
        if node is None:
            node = FakeNode(id=uuid.uuid4().hex, name=body.name, deployments=list(body.deployments))
            self.nodes[node.id] = node
        node.deployments = list(body.deployments)
        info = NodeInfo(
            id=node.id,
            name=node.name,
            labels=body.labels,
            role=body.role,
            address=body.address,
            deployments=node.deployments,
            registered_at=datetime.now(UTC),
            last_seen=datetime.now(UTC),
            stale=False,
        )
        return web.Response(text=info.model_dump_json(), content_type="application/json")

    async def _heartbeat(self, request: web.Request) -> web.Response:
        node = self._known(request)
        node.heartbeat = NodeHeartbeat.model_validate_json(await request.read())
        node.heartbeats += 1
        return web.Response(status=204)

    async def _desired(self, request: web.Request) -> web.Response:
        node = self._known(request)
        after = request.query.get("after")
        deadline = asyncio.get_running_loop().time() + float(request.query.get("wait", "0"))
        while True:
            state = self.desired(node)
            remaining = deadline - asyncio.get_running_loop().time()
            if after is None or state.revision != after or remaining <= 0:
                return web.Response(text=state.model_dump_json(), content_type="application/json")
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)

    async def _urls(self, request: web.Request) -> web.Response:
        body = BlobURLRequest.model_validate_json(await request.read())
        self.url_requests += 1
        expires = datetime.now(UTC) + timedelta(seconds=self.url_ttl)
        base = self.blob_base or self.origin.url
        urls = {
            b: BlobURL(url=f"{base}/blobs/{b}?expires={expires.timestamp():.0f}", expires_at=expires)
            for b in body.blobs
            if (self.origin.blobs / b).exists()
        }
        return web.Response(text=BlobURLs(urls=urls).model_dump_json(), content_type="application/json")

    async def _manifest(self, request: web.Request) -> web.Response:
        raw = self.origin.manifests.get(request.match_info["ref"])
        if raw is None:
            return web.json_response({"error": {"code": "not_found", "message": "no such version"}}, status=404)
        return web.Response(body=raw, content_type="application/json")
