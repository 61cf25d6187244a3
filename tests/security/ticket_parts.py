"""A fleet's control plane state for ticket tests, and asking it for tickets."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.controlplane.conftest import ADMIN_HEADERS, SeedVersions

Headers = dict[str, str]


def _pointer(client: httpx.Client, name: str, **body: Any) -> None:
    etag = client.get(f"/v1/deployments/{name}", headers=ADMIN_HEADERS).headers["etag"]
    response = client.put(f"/v1/deployments/{name}/pointer", json=body, headers={**ADMIN_HEADERS, "If-Match": etag})
    assert response.status_code == 200, response.text


@pytest.fixture
def fleet_state(cp_client: httpx.Client, seed_versions: SeedVersions) -> dict[str, str]:
    """Deployments ``chat`` (llama: stable v2, previous v1, canary v3) and ``code`` (coder: stable v1)."""
    llama = seed_versions("llama", ("v1", "v2", "v3", "v4"))
    coder = seed_versions("coder", ("v1",))
    seed_versions("llama", ("pending",), state="uploading")
    for name, model in (("chat", "llama"), ("code", "coder")):
        created = cp_client.post("/v1/deployments", json={"name": name, "model": model}, headers=ADMIN_HEADERS)
        assert created.status_code == 201, created.text
    _pointer(cp_client, "chat", stable="v1")
    _pointer(cp_client, "chat", stable="v2", canary="v3", canary_share=0.5)
    _pointer(cp_client, "code", stable="v1")
    return {**{f"llama-{k}": v for k, v in llama.items()}, "coder-v1": coder["v1"]}


def _ask(client: httpx.Client, headers: Headers, *versions: str) -> httpx.Response:
    return client.post("/v1/tickets", json={"versions": list(versions)}, headers=headers)
