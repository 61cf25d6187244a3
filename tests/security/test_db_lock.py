"""A locked database answers 503 + Retry-After within seconds, never a 500 after a stall.

Another process holds the write lock (SQLite: an ``EXCLUSIVE`` transaction from the ``sqlite3``
module; PostgreSQL: ``LOCK TABLE ... IN EXCLUSIVE MODE``, which blocks writers but not readers,
as SQLite's WAL mode does). Every kind of write the API takes (create, pointer move, node
registration, heartbeat) must fail fast with the ``database_unavailable`` problem, and succeed
again as soon as the lock is gone. Against a real uvicorn server on SQLite and PostgreSQL.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.controlplane.conftest import LiveControlPlane
from weightship.schemas import Role
from weightship.testing import problem

pytestmark = pytest.mark.timeout(120)

#: the API must answer within this while the lock is held (the engine waits 2 s for a lock)
PROMPT = 5.0


@contextmanager
def write_lock_held(database_url: str) -> Iterator[None]:
    """Another client holds the database's write lock for the duration."""
    if database_url.startswith("sqlite"):
        conn = sqlite3.connect(database_url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    import psycopg

    with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as pg:
        pg.execute("LOCK TABLE deployments, pointer_events, nodes, tokens IN EXCLUSIVE MODE")
        yield
        pg.rollback()


Write = Callable[[httpx.Client], httpx.Response]


def test_writes_to_a_locked_database_answer_503_with_retry_after_promptly(
    live_controlplane: LiveControlPlane,
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    seed_versions: Any,
    database_url: str,
) -> None:
    seed_versions("llama")
    operator, admin = role_headers[Role.operator], role_headers[Role.admin]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=operator).is_success
    node = cp_client.post("/v1/nodes/register", json={"name": "gpu-1", "deployments": ["chat"]}, headers=admin)
    node_id = node.json()["id"]
    writes: dict[str, Write] = {
        "create deployment": lambda c: c.post(
            "/v1/deployments", json={"name": "embed", "model": "llama"}, headers=operator
        ),
        "move pointer": lambda c: c.put(
            "/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={**operator, "If-Match": '"0"'}
        ),
        "register node": lambda c: c.post("/v1/nodes/register", json={"name": "gpu-2"}, headers=admin),
        "heartbeat": lambda c: c.post(f"/v1/nodes/{node_id}/heartbeat", json={}, headers=admin),
        "mint token": lambda c: c.post("/v1/tokens", json={"name": "t", "role": "agent"}, headers=admin),
    }

    def timed(write: Write) -> tuple[httpx.Response, float]:
        with httpx.Client(base_url=live_controlplane.url, timeout=60) as client:
            started = time.monotonic()
            response = write(client)
            return response, time.monotonic() - started

    with write_lock_held(database_url), ThreadPoolExecutor(max_workers=len(writes)) as pool:
        outcomes = dict(zip(writes, pool.map(timed, writes.values()), strict=True))

    for what, (response, seconds) in outcomes.items():
        assert response.status_code == 503, (what, response.status_code, response.text)
        assert response.headers["content-type"].startswith("application/problem+json"), what
        error = problem(response)
        assert error["code"] == "database_unavailable", (what, error)
        assert "retry" in error["detail"], (what, error)
        assert int(response.headers["retry-after"]) >= 1, what
        assert seconds < PROMPT, f"{what} answered after {seconds:.1f} s"

    with httpx.Client(base_url=live_controlplane.url, timeout=60) as client:
        for what, write in writes.items():
            response = write(client)
            assert response.is_success, (what, "after the lock is released", response.text)
