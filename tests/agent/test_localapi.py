"""The local API: what to serve, waiting until ready, long-polling switches, validation reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agent.epochs import EpochBook
from agent.localapi import LocalAPI
from agent.serving import Serving
from agent.store import VersionStore
from tests.agent.agent_processes import eventually
from tests.agent.local_versions import install
from weightship.manifest import Manifest
from weightship.schemas import LocalDeployment, NodeHeartbeat, ValidationReport
from weightship.testing import problem

pytestmark = pytest.mark.timeout(30)


@dataclass
class Node:
    store: VersionStore
    book: EpochBook
    serving: Serving
    http: httpx.AsyncClient
    reports: list[ValidationReport]
    v1: Manifest
    v2: Manifest

    async def switch(self, digest: str, epoch: int) -> None:
        """What the reconciler does on a switch."""
        self.book.apply("chat", epoch, digest, "m")
        self.store.link_current("chat", digest)
        await self.serving.changed()


@pytest.fixture
async def node(tmp_path: Path, make_model: Callable[..., Path]) -> AsyncIterator[Node]:
    store = VersionStore(tmp_path / "data")
    v1 = install(store, make_model("a", seed=1))
    v2 = install(store, make_model("b", seed=2))
    book = EpochBook(store.state_dir / "deployments.json")
    serving = Serving(store, book)
    reports: list[ValidationReport] = []
    api = LocalAPI(serving, NodeHeartbeat, reports.append)
    url = await api.start("127.0.0.1:0")
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        yield Node(store, book, serving, http, reports, v1, v2)
    await api.stop()


async def test_unknown_deployment_is_404_with_a_hint(node: Node) -> None:
    response = await node.http.get("/local/v1/deployments/chat")
    assert response.status_code == 404
    assert problem(response)["code"] == "not_found"
    assert "--deployment" in problem(response)["detail"]


async def parked(node: Node, count: int) -> None:
    """Wait until ``count`` local-API long-polls are parked in the agent (not merely sent)."""
    await eventually(lambda: node.serving.waiting == count, 5, f"{count} parked long-poll(s)")


#: a long-poll asks to wait far longer than the test lets it: only the switch notification can answer it in time
PARK = 60
#: how long a parked long-poll may take to answer once the switch happened
ANSWERED_WITHIN = 5


async def test_wait_returns_once_ready_and_long_polls_the_next_switch(node: Node) -> None:
    first = asyncio.create_task(
        node.http.get("/local/v1/deployments/chat/wait", params={"after_epoch": 0, "timeout": PARK}, timeout=PARK + 5)
    )
    await parked(node, 1)
    assert not first.done()
    await node.switch(node.v1.digest, 1)
    view = LocalDeployment.model_validate_json((await asyncio.wait_for(first, ANSWERED_WITHIN)).content)
    assert (view.digest, view.epoch, view.ready) == (node.v1.digest, 1, True)
    assert view.path == str(node.store.path(node.v1.digest))

    nxt = asyncio.create_task(
        node.http.get("/local/v1/deployments/chat/wait", params={"after_epoch": 1, "timeout": PARK}, timeout=PARK + 5)
    )
    await parked(node, 1)  # parked on epoch 1, which it already has: only the switch to 2 answers it
    assert not nxt.done()
    await node.switch(node.v2.digest, 2)
    answer = await asyncio.wait_for(nxt, ANSWERED_WITHIN)
    assert LocalDeployment.model_validate_json(answer.content).digest == node.v2.digest
    assert node.serving.waiting == 0
    listed = (await node.http.get("/local/v1/deployments")).json()
    assert [d["digest"] for d in listed] == [node.v2.digest]


async def test_wait_times_out_with_204(node: Node) -> None:
    await node.switch(node.v1.digest, 1)
    response = await node.http.get("/local/v1/deployments/chat/wait", params={"after_epoch": 1, "timeout": 0.2})
    assert response.status_code == 204


async def test_validation_reports_are_accepted_and_bad_ones_refused(node: Node) -> None:
    report = ValidationReport(deployment="chat", digest=node.v1.digest, passed=True, load_seconds=1.5)
    response = await node.http.post("/local/v1/validation", content=report.model_dump_json())
    assert response.status_code == 204
    assert node.reports == [report]
    bad = await node.http.post("/local/v1/validation", json={"deployment": "chat"})
    assert bad.status_code == 422
    assert problem(bad)["code"] == "invalid_request"
    assert "digest" in problem(bad)["detail"]
