"""Helpers the control-plane tests share: registered nodes, parked long-polls, pointer moves, role headers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controlplane import snapshot
from controlplane.state import AppState
from weightship.schemas import Role
from weightship.testing import eventually

Headers = dict[str, str]


@pytest.fixture
def agent(role_headers: dict[Role, Headers]) -> Headers:
    """Headers that may act for any node: the admin's (an agent's node token acts for its own node
    only; that is tests/security/test_node_identity.py's subject)."""
    return role_headers[Role.admin]


@pytest.fixture
def operator(role_headers: dict[Role, Headers]) -> Headers:
    """Headers of an operator token."""
    return role_headers[Role.operator]


@pytest.fixture
def chat(cp_client: httpx.Client, operator: Headers, seed_versions: Any) -> dict[str, str]:
    """Deployment ``chat`` of ``llama`` at stable v1 (epoch 1); returns the digests of v1..v3."""
    digests: dict[str, str] = seed_versions("llama")
    assert (
        cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=operator).status_code == 201
    )
    set_pointer(cp_client, operator, stable="v1")
    return digests


def set_pointer(client: httpx.Client, headers: Headers, name: str = "chat", **body: Any) -> dict[str, Any]:
    """Read the ETag, then PUT the pointer with it."""
    etag = client.get(f"/v1/deployments/{name}", headers=headers).headers["etag"]
    response = client.put(f"/v1/deployments/{name}/pointer", json=body, headers={**headers, "If-Match": etag})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def register(client: httpx.Client, headers: Headers, name: str, *deployments: str, **extra: Any) -> str:
    """Register a node; returns its id."""
    body = {"name": name, "deployments": list(deployments), **extra}
    response = client.post("/v1/nodes/register", json=body, headers=headers)
    assert response.status_code == 200, response.text
    node_id: str = response.json()["id"]
    return node_id


def desired(client: httpx.Client, headers: Headers, node_id: str, **params: Any) -> dict[str, Any]:
    """``GET /v1/nodes/{id}/desired``."""
    response = client.get(f"/v1/nodes/{node_id}/desired", params=params, headers=headers)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds, or fail after ``timeout`` seconds (``weightship.testing.eventually``)."""
    eventually(condition, timeout, what, interval=0.01)


class BackgroundPoll:
    """A long-poll running in a thread; records the response and when it arrived."""

    def __init__(self, url: str, headers: Headers, node_id: str, after: str, wait: float) -> None:
        self.response: httpx.Response | None = None
        self.arrived = 0.0
        self._thread = threading.Thread(target=self._run, args=(url, headers, node_id, after, wait), daemon=True)
        self._thread.start()

    def _run(self, url: str, headers: Headers, node_id: str, after: str, wait: float) -> None:
        with httpx.Client(base_url=url, timeout=wait + 30) as client:
            params: dict[str, str | float] = {"after": after, "wait": wait}
            self.response = client.get(f"/v1/nodes/{node_id}/desired", params=params, headers=headers)
        self.arrived = time.monotonic()

    def join(self, timeout: float) -> httpx.Response:
        """The response, once it arrived."""
        self._thread.join(timeout)
        assert self.response is not None, "the long-poll did not answer"
        return self.response


def waiting_polls(state: AppState) -> float:
    """How many desired-state long-polls the server is holding right now."""
    return state.metrics_registry.get_sample_value("weightship_desired_long_polls") or 0.0


@pytest.fixture
def quiet_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshots' backstop re-read (one query per RECHECK_SECONDS) pushed out of the test's window.

    List it before ``live_controlplane`` so the server starts with it.
    """
    monkeypatch.setattr(snapshot, "RECHECK_SECONDS", 3600.0)


def park(url: str, headers: Headers, client: httpx.Client, node_id: str, wait: float = 30) -> BackgroundPoll:
    """A long-poll on the node's current revision, running in a thread."""
    return BackgroundPoll(url, headers, node_id, desired(client, headers, node_id)["revision"], wait=wait)
