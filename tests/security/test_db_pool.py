"""The connection pool cannot be exhausted into a stall: no request holds two connections at once.

A pointer write that lost its compare-and-swap used to open a second session (to read the winner's
epoch) while still holding its first; forty such writers at once took every pooled connection
and then waited for one more, so all of them answered 500 after the 30 s pool timeout and the
whole API stalled behind them. On SQLite and PostgreSQL, against a real uvicorn server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from controlplane.state import AppState
from tests.controlplane.conftest import LiveControlPlane
from weightship.schemas import Role
from weightship.testing import problem

pytestmark = pytest.mark.timeout(120)

WRITERS = 40


@pytest.fixture
def chat(cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], seed_versions: Any) -> str:
    """Deployment ``chat`` of ``llama`` with its pointer set once (epoch 1) and rolled back once (epoch 2)."""
    seed_versions("llama")
    operator = role_headers[Role.operator]
    assert (
        cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=operator).status_code == 201
    )
    for epoch, ref in ((0, "v1"), (1, "v2")):
        response = cp_client.put(
            "/v1/deployments/chat/pointer", json={"stable": ref}, headers={**operator, "If-Match": f'"{epoch}"'}
        )
        assert response.status_code == 200, response.text
    return "chat"


def _stale_write(url: str, headers: dict[str, str], index: int, barrier: threading.Barrier) -> tuple[int, float]:
    """One stale writer: half move the pointer, half roll back, all with an old ``If-Match``."""
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/healthz")  # connect first, so the writes leave together
        barrier.wait(timeout=30)
        started = time.monotonic()
        stale = {**headers, "If-Match": '"1"'}
        if index % 2:
            response = client.post("/v1/deployments/chat/rollback", json={"reason": "storm"}, headers=stale)
        else:
            response = client.put("/v1/deployments/chat/pointer", json={"stable": "v3"}, headers=stale)
        return response.status_code, time.monotonic() - started


def test_forty_stale_pointer_writers_get_412_within_a_second_while_reads_stay_prompt(
    live_controlplane: LiveControlPlane,
    role_headers: dict[Role, dict[str, str]],
    chat: str,
) -> None:
    operator = role_headers[Role.operator]
    barrier = threading.Barrier(WRITERS + 1)
    storm_over = threading.Event()
    reads: list[tuple[int, float]] = []

    def reader() -> None:
        with httpx.Client(base_url=live_controlplane.url, timeout=60) as client:
            client.get("/healthz")
            barrier.wait(timeout=30)
            while not storm_over.is_set() or not reads:
                started = time.monotonic()
                response = client.get(f"/v1/deployments/{chat}", headers=operator)
                reads.append((response.status_code, time.monotonic() - started))

    reading = threading.Thread(target=reader)
    reading.start()
    try:
        with ThreadPoolExecutor(max_workers=WRITERS) as pool:
            results = list(
                pool.map(lambda i: _stale_write(live_controlplane.url, operator, i, barrier), range(WRITERS))
            )
    finally:
        storm_over.set()
        reading.join(timeout=60)

    print(  # the figures, for -s runs
        f"stale_writers={WRITERS} slowest_412_s={max(s for _, s in results):.3f} "
        f"reads={len(reads)} slowest_read_s={max(s for _, s in reads):.3f}"
    )
    assert sorted(status for status, _ in results) == [412] * WRITERS
    slowest = max(seconds for _, seconds in results)
    assert slowest < 1.0, f"the slowest stale writer took {slowest:.2f} s"
    assert {status for status, _ in reads} == {200}
    assert max(seconds for _, seconds in reads) < 1.0, f"a read during the storm took {max(reads)[1]:.2f} s"
    final = httpx.get(f"{live_controlplane.url}/v1/deployments/{chat}", headers=operator, timeout=10).json()
    assert final["epoch"] == 2, "no stale writer moved the pointer"


@pytest.fixture
def checkouts_per_thread(cp_state: AppState) -> Iterator[list[str]]:
    """Records a violation whenever one thread checks out a second pooled connection while holding one."""
    held = threading.local()
    violations: list[str] = []

    def on_checkout(*_args: Any) -> None:
        held.count = getattr(held, "count", 0) + 1
        if held.count > 1:
            violations.append(threading.current_thread().name)

    def on_checkin(*_args: Any) -> None:
        held.count = max(0, getattr(held, "count", 0) - 1)

    event.listen(cp_state.engine, "checkout", on_checkout)
    event.listen(cp_state.engine, "checkin", on_checkin)
    try:
        yield violations
    finally:
        event.remove(cp_state.engine, "checkout", on_checkout)
        event.remove(cp_state.engine, "checkin", on_checkin)


def test_no_route_holds_two_database_connections_at_once(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    chat: str,
    checkouts_per_thread: list[str],
) -> None:
    operator, admin = role_headers[Role.operator], role_headers[Role.admin]
    stale = {**operator, "If-Match": '"0"'}
    calls: list[tuple[str, str, dict[str, Any] | None, dict[str, str], int]] = [
        ("PUT", f"/v1/deployments/{chat}/pointer", {"stable": "v3"}, stale, 412),
        ("POST", f"/v1/deployments/{chat}/rollback", {}, stale, 412),
        ("PUT", f"/v1/deployments/{chat}/pointer", {"stable": "v3"}, {**operator, "If-Match": '"2"'}, 200),
        ("POST", f"/v1/deployments/{chat}/rollback", {}, operator, 200),
        ("POST", "/v1/deployments", {"name": chat, "model": "llama"}, operator, 409),
        ("GET", "/v1/deployments", None, operator, 200),
        ("GET", f"/v1/deployments/{chat}/history", None, operator, 200),
        ("GET", f"/v1/deployments/{chat}/status", None, operator, 200),
        ("GET", "/v1/models", None, operator, 200),
        ("GET", "/v1/models/llama/versions", None, operator, 200),
        ("POST", "/v1/nodes/register", {"name": "gpu-1", "deployments": [chat]}, admin, 200),
        ("GET", "/v1/nodes", None, operator, 200),
        ("POST", "/v1/tokens", {"name": "extra", "role": "operator"}, admin, 201),
        ("GET", "/v1/tokens", None, admin, 200),
        ("GET", "/readyz", None, {}, 200),
        ("GET", "/metrics", None, {}, 200),
    ]
    for method, path, body, headers, expected in calls:
        response = cp_client.request(method, path, json=body, headers=headers)
        assert response.status_code == expected, (method, path, response.text)
    node_id = cp_client.get("/v1/nodes", headers=operator).json()[0]["id"]
    assert cp_client.post(f"/v1/nodes/{node_id}/heartbeat", json={}, headers=admin).status_code == 204
    assert cp_client.get(f"/v1/nodes/{node_id}/desired", headers=admin).status_code == 200
    assert checkouts_per_thread == [], "a request opened a second session while holding one"


def test_an_exhausted_pool_answers_503_with_retry_after_promptly(
    cp_client: httpx.Client,
    cp_state: AppState,
    role_headers: dict[Role, dict[str, str]],
) -> None:
    operator = role_headers[Role.operator]
    # every connection the pool may open (pool size plus as many again), with the default timeout
    held = [cp_state.engine.connect() for _ in range(2 * cp_state.settings.database_pool_size)]
    try:
        started = time.monotonic()
        response = cp_client.get("/v1/deployments", headers=operator)
        elapsed = time.monotonic() - started
    finally:
        for conn in held:
            conn.close()
    assert response.status_code == 503, response.text
    assert problem(response)["code"] == "database_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    assert elapsed < 5.0, f"answered after {elapsed:.1f} s"
    assert cp_client.get("/v1/deployments", headers=operator).status_code == 200, "the pool recovers at once"
