"""Hostile sizes: every body is bounded by its route (413), every integer by its schema (422).

Before, a 100 MB heartbeat or a 50 MB registration was read, parsed and stored, and an integer
past 64 bits (``history?before_epoch=9223372036854775808``) reached the database and came back as
a 500. Bodies are refused by one middleware for every route, before any handler keeps a byte; a
part upload still takes a whole chunk. Against a real uvicorn server (the database plays no part,
so SQLite only).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import ModelMaker
from tests.controlplane.conftest import LiveControlPlane, Publisher
from weightship.manifest import build_manifest
from weightship.schemas import INT64_MAX, Role, VersionInfo
from weightship.testing import problem

pytestmark = pytest.mark.timeout(120)

MB = 1024 * 1024


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: body and integer limits are decided before any database access."""
    return f"sqlite:///{tmp_path / 'controlplane.db'}"


@pytest.fixture
def node_id(cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]]) -> str:
    """A registered node."""
    response = cp_client.post("/v1/nodes/register", json={"name": "gpu-1"}, headers=role_headers[Role.admin])
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def _declare_only(url: str, method: str, path: str, headers: dict[str, str], declared: int) -> tuple[int, Any, float]:
    """Send only the headers of a request declaring ``declared`` body bytes; the answer, and how long it took."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        started = time.monotonic()
        conn.putrequest(method, path)
        for name, value in {**headers, "Content-Type": "application/json", "Content-Length": str(declared)}.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read()), time.monotonic() - started
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("method", "path", "role", "declared"),
    [
        ("POST", "/v1/nodes/register", Role.agent, 50 * MB),
        ("POST", "/v1/nodes/{node}/heartbeat", Role.agent, 100 * MB),
        ("PUT", "/v1/deployments/chat/pointer", Role.operator, 10 * MB),
        ("POST", "/v1/deployments/chat/rollback", Role.operator, 10 * MB),
        ("POST", "/v1/uploads", Role.publisher, 1024 * MB),
        ("POST", "/v1/tokens", Role.admin, 1 * MB),
        ("GET", "/v1/nodes", Role.admin, 1 * MB),
    ],
)
def test_a_body_declared_over_its_route_limit_is_refused_before_it_is_sent(
    live_controlplane: LiveControlPlane,
    role_headers: dict[Role, dict[str, str]],
    node_id: str,
    method: str,
    path: str,
    role: Role,
    declared: int,
) -> None:
    status, body, seconds = _declare_only(
        live_controlplane.url, method, path.format(node=node_id), role_headers[role], declared
    )
    assert status == 413, body
    assert body["code"] == "too_large"
    assert "at most" in body["detail"]
    assert seconds < 5.0


def _stream(total: int, piece: int = 64 * 1024) -> Iterator[bytes]:
    """``total`` bytes of a JSON-looking body, with no length declared (chunked transfer)."""
    yield b'{"health": {"errors": ["'
    sent = 0
    while sent < total:
        yield b"x" * piece
        sent += piece


@pytest.mark.parametrize(
    ("path", "role", "total"),
    [
        ("/v1/nodes/{node}/heartbeat", Role.agent, 1 * MB + 64 * 1024),
        ("/v1/nodes/register", Role.agent, 256 * 1024),
    ],
)
def test_a_chunked_body_streaming_past_its_limit_is_refused_and_nothing_is_stored(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    node_id: str,
    path: str,
    role: Role,
    total: int,
) -> None:
    headers = {**role_headers[role], "Content-Type": "application/json"}
    response = cp_client.post(path.format(node=node_id), content=_stream(total), headers=headers)
    assert response.status_code == 413, response.text
    assert problem(response)["code"] == "too_large"
    nodes = cp_client.get("/v1/nodes", headers=role_headers[Role.operator]).json()
    assert [(n["name"], n["health"]["errors"]) for n in nodes] == [("gpu-1", [])]


def test_a_heartbeat_of_a_large_but_real_node_is_accepted(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    node_id: str,
) -> None:
    inventory = [
        {"digest": f"sha256:{i:064x}", "state": "ready", "bytes_total": 10**12, "bytes_present": 10**12}
        for i in range(500)
    ]
    response = cp_client.post(
        f"/v1/nodes/{node_id}/heartbeat", json={"inventory": inventory}, headers=role_headers[Role.admin]
    )
    assert response.status_code == 204, response.text


def test_a_part_upload_still_takes_a_whole_chunk_far_over_the_default_limit(
    publisher: Publisher,
    make_model: ModelMaker,
) -> None:
    root = make_model("big", tensors_mb=3.0)
    manifest = build_manifest(root, "big", chunk_size=1 * MB)
    session = publisher.session(manifest)
    assert max(p.length for b in session.blobs for p in b.parts) == 1 * MB
    assert publisher.upload(session, root, manifest) > 2 * MB
    response = publisher.commit(session)
    assert response.status_code == 200, response.text
    assert VersionInfo.model_validate_json(response.content).digest == manifest.digest


TOO_BIG = INT64_MAX + 1


@pytest.mark.parametrize(
    ("what", "method", "path", "body"),
    [
        ("history before_epoch", "GET", f"/v1/deployments/chat/history?before_epoch={TOO_BIG}", None),
        ("history limit", "GET", f"/v1/deployments/chat/history?limit={TOO_BIG}", None),
        ("blob URL expiry", "GET", f"/v1/blobs/{'a' * 64}?expires={TOO_BIG}&sig=x", None),
        ("counter", "POST", "/v1/nodes/{node}/heartbeat", {"counters": {"bytes_downloaded": TOO_BIG}}),
        ("negative counter", "POST", "/v1/nodes/{node}/heartbeat", {"counters": {"chunks_rejected": -1}}),
        (
            "inventory size",
            "POST",
            "/v1/nodes/{node}/heartbeat",
            {
                "inventory": [
                    {"digest": f"sha256:{0:064x}", "state": "ready", "bytes_total": TOO_BIG, "bytes_present": 0}
                ]
            },
        ),
        (
            "served epoch",
            "POST",
            "/v1/nodes/{node}/heartbeat",
            {"deployments": [{"name": "c", "digest": None, "epoch": TOO_BIG}]},
        ),
        ("disk size", "POST", "/v1/nodes/{node}/heartbeat", {"health": {"disk_total": 10**30}}),
    ],
)
def test_integers_beyond_64_bits_are_422_not_500(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    node_id: str,
    what: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    response = cp_client.request(method, path.format(node=node_id), json=body, headers=role_headers[Role.admin])
    assert response.status_code == 422, (what, response.text)
    assert problem(response)["code"] == "invalid_request", what


def test_a_huge_part_number_is_a_client_error(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
) -> None:
    response = cp_client.put(
        f"/v1/uploads/up_x/blobs/{'a' * 64}/parts/{TOO_BIG}", content=b"x", headers=role_headers[Role.publisher]
    )
    assert 400 <= response.status_code < 500, response.text
