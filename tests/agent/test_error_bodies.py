"""The agent's one error boundary: every error its listeners answer is RFC 9457 problem details.

A walk over the route tables of the local API and of the peer listener (with the tracker's
routes mounted, as on a cluster cache): each route is sent what makes it fail (a wrong method,
missing or malformed parameters, no ticket, a garbage or oversized body, the route's own refusals)
and every error answer must be ``application/problem+json`` with our stable ``code``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from agent.epochs import EpochBook
from agent.localapi import LocalAPI
from agent.peerserver import PeerServer, VersionChunks
from agent.problems import answer_error
from agent.serving import Serving
from agent.store import VersionStore
from agent.tickets import TicketKeeper
from agent.tracker import Tracker
from agent.tracker_api import TrackerRoutes
from tests.agent.local_versions import install
from tests.agent.tracker_parts import Signer
from weightship.errors import NotFoundError
from weightship.manifest import Manifest
from weightship.schemas import NodeHeartbeat
from weightship.testing import problem

pytestmark = pytest.mark.timeout(60)

HEX = "ab" * 32
VERSION = "sha256:" + "cd" * 32
#: more than aiohttp's default body limit (1 MiB): the framework's own 413
OVERSIZED = b"x" * (1024 * 1024 + 1)


@dataclass
class Listeners:
    local: LocalAPI
    peer: PeerServer
    signer: Signer
    manifest: Manifest


@pytest.fixture
async def listeners(tmp_path: Path, make_model: Callable[..., Path]) -> AsyncIterator[Listeners]:
    store = VersionStore(tmp_path / "data")
    manifest = install(store, make_model("a", seed=1))
    book = EpochBook(store.state_dir / "deployments.json")
    local = LocalAPI(Serving(store, book), NodeHeartbeat, lambda _report: None)
    await local.start("127.0.0.1:0")
    signer = Signer()
    keeper = TicketKeeper(signer)
    await keeper.refresh_keys()

    async def manifests(version: str) -> Manifest:
        if version != manifest.digest:
            raise NotFoundError(f"the cache holds no manifest {version}")
        return manifest

    routes = TrackerRoutes(Tracker(), keeper, manifests)
    chunks = VersionChunks(lambda: {manifest.digest: manifest}, store.path, {})
    peer = PeerServer(chunks, keeper, extra_routes=routes.mount)
    await peer.start("127.0.0.1:0")
    try:
        yield Listeners(local, peer, signer, manifest)
    finally:
        await peer.stop()
        await local.stop()


def _requests(app: web.Application, auth: dict[str, str]) -> list[tuple[str, str, dict[str, str], bytes]]:
    """For each route of ``app``: the requests that make it fail, as ``(method, path, headers, body)``."""
    wanted: list[tuple[str, str, dict[str, str], bytes]] = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue  # aiohttp adds HEAD beside each GET
        path = route.resource.canonical if route.resource is not None else "/"
        path = path.replace("{name}", "chat").replace("{chunk}", HEX)
        wanted.append(("PATCH", path, {}, b""))  # 405 everywhere
        # A GET carries no body: the peer listener refuses any body on a GET (413) before it checks more.
        bodies = (b"", b"", b"") if route.method == "GET" else (b"not json", b"{}", b"[]")
        for headers in ({}, auth):
            # ``timeout=0``: the local API's long-poll answers at once
            wanted.append((route.method, path + "?timeout=0", headers, bodies[0]))
            wanted.append((route.method, path + "?after_epoch=x&version=nope&chunk=nope&index=x", headers, bodies[1]))
            wanted.append(
                (route.method, path + f"?version={VERSION}&chunk={HEX}&blob={HEX}&index=0&timeout=0", headers, bodies[2])
            )
        if route.method == "GET":
            wanted.append((route.method, path + "?timeout=0", auth, b"a body"))  # 413 on the peer listener
        if route.method == "POST":
            wanted.append((route.method, path, auth, OVERSIZED))
    wanted.append(("GET", "/no/such/route", {}, b""))
    return wanted


async def _walk(base: str, app: web.Application, auth: dict[str, str]) -> set[tuple[str, int, str]]:
    """Send every failing request; check each error answer is a problem; ``(path, status, code)`` seen."""
    seen: set[tuple[str, int, str]] = set()
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for method, path, headers, body in _requests(app, auth):
            response = await http.request(method, path, headers=headers, content=body)
            if response.status_code < 400:
                continue
            body_of = problem(response)  # media type, every member, status and type agree
            assert body_of["instance"] == path.split("?")[0], body_of
            assert body_of["detail"], body_of
            seen.add((path.split("?")[0], response.status_code, body_of["code"]))
    return seen


async def test_every_error_of_the_local_api_is_problem_details(listeners: Listeners) -> None:
    seen = await _walk(listeners.local.url, listeners.local.app, {})
    statuses = {status for _path, status, _code in seen}
    assert {400, 404, 405, 413, 422} <= statuses, seen
    assert ("/local/v1/deployments/chat", 404, "not_found") in seen
    assert ("/no/such/route", 404, "no_route") in seen
    assert ("/local/v1/validation", 422, "invalid_request") in seen


async def test_every_error_of_the_peer_listener_and_tracker_is_problem_details(listeners: Listeners) -> None:
    auth = {"Authorization": "Ticket " + listeners.signer.sign("n1", [VERSION, listeners.manifest.digest])}
    seen = await _walk(listeners.peer.url, listeners.peer.app, auth)
    statuses = {status for _path, status, _code in seen}
    assert {400, 401, 404, 405, 413} <= statuses, seen
    assert (f"/v1/chunks/{HEX}", 401, "ticket_missing") in seen
    assert ("/v1/tracker/sources", 404, "not_found") in seen  # a version the cache holds no manifest of


async def test_a_busy_peer_answers_a_problem_with_retry_after(listeners: Listeners) -> None:
    listeners.peer.upload_concurrency = 0
    auth = {"Authorization": "Ticket " + listeners.signer.sign("n1", [VERSION])}
    url = f"{listeners.peer.url}/v1/chunks/{HEX}?version={VERSION}&blob={HEX}&index=0"
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(url, headers=auth)
    assert response.status_code == 503
    assert problem(response)["code"] == "unavailable"
    assert response.headers["Retry-After"] == "1"
    assert problem(response)["retry_after"] == 1


async def test_a_missing_ticket_names_the_ticket_scheme(listeners: Listeners) -> None:
    url = f"{listeners.peer.url}/v1/chunks/{HEX}?version={VERSION}&blob={HEX}&index=0"
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(url)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Ticket"
    assert problem(response)["code"] == "ticket_missing"


async def test_an_unexpected_failure_is_a_500_problem_not_a_traceback(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    store = VersionStore(tmp_path / "data")
    install(store, make_model("a", seed=1))

    def broken_status() -> NodeHeartbeat:
        raise RuntimeError("the heartbeat builder broke")

    local = LocalAPI(Serving(store, EpochBook(store.state_dir / "deployments.json")), broken_status, print)
    url = await local.start("127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            response = await http.get("/local/v1/status")
        assert response.status_code == 500
        body = problem(response)
        assert body["code"] == "internal"
        assert "RuntimeError" in body["detail"]
        assert "the heartbeat builder broke" not in body["detail"]  # internals stay in the log
    finally:
        await local.stop()


async def test_an_agent_client_reads_the_detail_of_a_peer_refusal(listeners: Listeners) -> None:
    """The agent's own client of other agents (``agent.problems.answer_error``) reads the problem's detail."""
    url = f"{listeners.peer.url}/v1/chunks/{HEX}?version={VERSION}&blob={HEX}&index=0"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        error = await answer_error(response, "peer n1")
    assert error.code == "ticket_missing"
    assert "ticket" in error.message.lower()
