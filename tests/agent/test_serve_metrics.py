"""Model servers' counters summed per deployment and version on a node: restarts never go negative."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agent.epochs import EpochBook
from agent.localapi import LocalAPI
from agent.servemetrics import LIVE_SECONDS, MAX_VERSIONS, ServeMetricsBook
from agent.serving import Serving
from agent.store import VersionStore
from weightship.schemas import NodeHeartbeat, ServeCounters, ServeReport, VersionServeMetrics
from weightship.testing import ManualClock, problem

pytestmark = pytest.mark.timeout(30)

V1, V2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def report(instance: str, *versions: ServeCounters, deployment: str = "chat") -> ServeReport:
    return ServeReport(deployment=deployment, instance=instance, versions=list(versions))


def counters(digest: str, requests: int, errors: int = 0, **more: int) -> ServeCounters:
    le = [0] * 5 + [requests] * 7  # every request within 0.25 s
    return ServeCounters(digest=digest, requests=requests, errors=errors, latency_le=le, **more)


def entry(book: ServeMetricsBook, digest: str, deployment: str = "chat") -> VersionServeMetrics:
    snapshot = book.snapshot()
    assert snapshot is not None
    (found,) = [v for v in snapshot.versions if v.digest == digest and v.deployment == deployment]
    return found


def test_two_model_servers_on_a_node_are_summed_per_version() -> None:
    book = ServeMetricsBook(ManualClock())
    assert book.snapshot() is None
    book.receive(report("gpu0", counters(V1, 10, 1, queue_depth=2)))
    book.receive(report("gpu1", counters(V1, 5, queue_depth=3), counters(V2, 7, load_failures=1)))
    book.receive(report("gpu0", counters(V1, 30, 2, queue_depth=1)))
    v1 = entry(book, V1)
    assert (v1.requests, v1.errors, v1.queue_depth, v1.instances) == (35, 2, 4, 2)
    assert v1.latency_le[-1] == 35
    assert (entry(book, V2).requests, entry(book, V2).load_failures) == (7, 1)


def test_a_restarted_model_server_adds_its_new_counts_and_never_subtracts() -> None:
    book = ServeMetricsBook(ManualClock())
    book.receive(report("old", counters(V1, 100, 10)))
    book.receive(report("new", counters(V1, 3, 1)))  # a new process: counts from 0
    assert (entry(book, V1).requests, entry(book, V1).errors) == (103, 11)
    book.receive(report("new", counters(V1, 2)))  # went down under the same instance: a reset too
    book.receive(report("new", counters(V1, 6, 1)))
    v1 = entry(book, V1)
    assert (v1.requests, v1.errors) == (109, 12)
    assert v1.latency_le[-1] == 109
    assert all(b >= a for a, b in zip(v1.latency_le, v1.latency_le[1:], strict=False))


def test_a_silent_server_stops_adding_queue_depth_but_keeps_its_counts() -> None:
    clock = ManualClock()
    book = ServeMetricsBook(clock)
    book.receive(report("gpu0", counters(V1, 10, queue_depth=4)))
    clock.now += LIVE_SECONDS + 1
    v1 = entry(book, V1)
    assert (v1.requests, v1.queue_depth, v1.instances) == (10, 0, 0)


def test_versions_kept_are_bounded() -> None:
    book = ServeMetricsBook(ManualClock())
    for i in range(MAX_VERSIONS + 5):
        book.receive(report("gpu0", counters("sha256:" + f"{i:064x}", 1)))
    snapshot = book.snapshot()
    assert snapshot is not None
    assert len(snapshot.versions) == MAX_VERSIONS
    NodeHeartbeat(serve=snapshot)  # what the schema accepts


async def test_local_api_takes_pushes_and_refuses_a_malformed_histogram(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "data")
    book = ServeMetricsBook(ManualClock())
    api = LocalAPI(Serving(store, EpochBook(store.state_dir / "deployments.json")), NodeHeartbeat, print, book.receive)
    url = await api.start("127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            good = report("gpu0", counters(V1, 4)).model_dump(mode="json")
            assert (await client.post("/local/v1/serve-metrics", json=good)).status_code == 204
            bad = {**good, "versions": [{**good["versions"][0], "latency_le": [3, 2, 1]}]}
            refused = await client.post("/local/v1/serve-metrics", json=bad)
            assert refused.status_code == 422
            assert "latency_le must hold 12 cumulative" in problem(refused)["detail"]
            hostile = {**good, "instance": "../../etc"}
            assert (await client.post("/local/v1/serve-metrics", json=hostile)).status_code == 422
    finally:
        await api.stop()
    assert entry(book, V1).requests == 4
