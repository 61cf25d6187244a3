"""Real parts for tracker tests: signed tickets, the tracker's HTTP routes on a loopback port, chunk servers."""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from agent.problems import boundary
from agent.tickets import TicketKeeper
from agent.tracker import Tracker
from agent.tracker_api import TrackerRoutes
from weightship.manifest import Manifest
from weightship.schemas import TicketGrant, TicketKeys
from weightship.tickets import Ticket, key_id, new_private_key, public_key_text, sign_ticket


class Signer:
    """Plays the control plane's ticket signer: one ed25519 key, tickets for any node and versions."""

    def __init__(self) -> None:
        self.key = new_private_key()
        self.kid = key_id(self.key.public_key())

    def sign(self, node: str, versions: list[str], ttl: int = 600) -> str:
        now = int(time.time())
        return sign_ticket(self.key, Ticket(self.kid, node, frozenset(versions), now, now + ttl))

    async def ticket_keys(self) -> TicketKeys:
        return TicketKeys(keys={self.kid: public_key_text(self.key.public_key())})

    async def ticket(self, versions: list[str]) -> TicketGrant:
        raise NotImplementedError  # the tracker only checks tickets


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def tracker_server(tracker: Tracker, signer: Signer, manifests: dict[str, Manifest]) -> tuple[web.AppRunner, str]:
    keeper = TicketKeeper(signer)
    await keeper.refresh_keys()

    async def manifest(version: str) -> Manifest:
        return manifests[version]

    app = web.Application(middlewares=[boundary("the tracker", challenge="Ticket")])  # as on the peer listener
    TrackerRoutes(tracker, keeper, manifest).mount(app)
    return await serve(app)


def chunk_server(
    model_dir: Path, manifest: Manifest, poison: bool = False, busy_first: int = 0
) -> tuple[web.Application, list[str]]:
    """A peer serving chunks of ``manifest`` from ``model_dir`` (or, poisoned, flipped bytes).

    With ``busy_first`` it answers 503 (over its upload limit) to the first requests for each chunk.
    """
    served: list[str] = []
    refused: dict[str, int] = {}
    by_digest = {}
    for entry in manifest.files:
        for index, digest in enumerate(entry.chunks):
            by_digest[digest] = (entry.path, *entry.chunk_range(index, manifest.chunk_size))

    async def chunk(request: web.Request) -> web.Response:
        digest = request.match_info["chunk"]
        if refused.get(digest, 0) < busy_first:
            refused[digest] = refused.get(digest, 0) + 1
            return web.Response(status=503, headers={"Retry-After": "1"})
        path, start, end = by_digest[digest]
        with open(model_dir / path, "rb") as handle:  # noqa: ASYNC230 (small test files)
            handle.seek(start)
            data = bytearray(handle.read(end - start))
        if poison:
            data[0] ^= 0xFF
        served.append(digest)
        return web.Response(body=bytes(data))

    app = web.Application()
    app.router.add_get("/v1/chunks/{chunk}", chunk)
    return app, served
