"""Bad input to the publish routes: each refused with a clear error, and nothing kept.

These depend on neither the origin store nor the database, so they run on the local store and
SQLite only; the store- and database-dependent behaviour is in ``test_publish.py``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from controlplane.persistence.rows import ModelRow, UploadSessionRow
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from weightship.manifest import MAX_MANIFEST_BYTES, canonical_json
from weightship.schemas import Role

if TYPE_CHECKING:
    from tests.conftest import ModelMaker
    from tests.controlplane.conftest import Publisher

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: nothing here depends on the database."""
    return f"sqlite:///{tmp_path / 'controlplane.db'}"


Edit = Callable[[dict[str, Any]], None]


def _set_path(path: str) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        doc["files"][0]["path"] = path

    return edit


def _set(key: str, value: object) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        doc[key] = value

    return edit


def _drop_chunk(doc: dict[str, Any]) -> None:
    doc["files"][-1]["chunks"].pop()


BAD_MANIFESTS: list[tuple[str, Edit, str]] = [
    ("path traversal", _set_path("../../etc/cron.d/evil"), "traversal"),
    ("absolute path", _set_path("/etc/passwd"), "absolute"),
    ("backslash", _set_path("a\\b.json"), "backslash"),
    ("hidden name", _set_path(".git/config"), "name grammar"),
    ("unknown schema", _set("schema", "other/v9"), "schema"),
    ("bad chunk size", _set("chunk_size", 1000), "power of two"),
    ("bad model name", _set("model", "Bad Name"), "invalid model name"),
    ("chunks missing", _drop_chunk, "chunk digests"),
]


def test_invalid_manifests_are_refused(publisher: Publisher, make_model: ModelMaker, cp_state: AppState) -> None:
    """A manifest that breaks the contract is a 400 naming the problem; no session is opened."""
    good = json.loads(publisher.manifest(make_model("m", tensors_mb=0.1), "llama").raw)
    for case, edit, message in BAD_MANIFESTS:
        doc = json.loads(json.dumps(good))
        edit(doc)
        response = publisher.open(canonical_json(doc))
        assert response.status_code == 400, (case, response.text)
        assert problem(response)["code"] == "invalid_manifest", case
        assert message in problem(response)["detail"], case
    with cp_state.sessions() as session:
        assert session.query(UploadSessionRow).count() == 0


def test_a_manifest_giving_one_digest_two_contents_is_refused(publisher: Publisher, make_model: ModelMaker) -> None:
    """Two files with the same sha256 but different sizes contradict each other: 400."""
    doc = json.loads(publisher.manifest(make_model("a", tensors_mb=0.3), "llama").raw)
    files = {f["path"]: f for f in doc["files"]}
    files["model.safetensors"]["sha256"] = files["config.json"]["sha256"]
    response = publisher.open(canonical_json(doc))
    assert response.status_code == 400, response.text
    assert "claim the same sha256" in problem(response)["detail"]


def test_a_manifest_that_is_not_canonical_is_refused(publisher: Publisher, make_model: ModelMaker) -> None:
    """Re-serialised bytes would not hash to the digest, so they are refused."""
    doc = json.loads(publisher.manifest(make_model("m", tensors_mb=0.1), "llama").raw)
    response = publisher.open(json.dumps(doc, indent=2).encode())
    assert response.status_code == 400
    assert "canonical" in problem(response)["detail"]


def test_an_oversized_manifest_is_refused(publisher: Publisher) -> None:
    """A manifest over the size limit is refused before it is parsed."""
    huge = b'{"files":"' + b"x" * MAX_MANIFEST_BYTES + b'"}'
    response = publisher.open(huge)
    assert response.status_code == 400
    assert "exceeds" in problem(response)["detail"]


def test_a_request_declaring_an_oversized_body_is_refused_unread(publisher: Publisher, cp_client: httpx.Client) -> None:
    """The declared Content-Length alone is enough to refuse: the answer comes before the body is sent."""
    url = cp_client.base_url
    head = (
        f"POST /v1/uploads HTTP/1.1\r\nHost: {url.host}\r\n"
        f"Authorization: {publisher.headers['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {3 * MAX_MANIFEST_BYTES}\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port or 80), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"manifest": "')
        answer = b""
        while b"\r\n\r\n" not in answer:
            piece = sock.recv(4096)
            assert piece, "connection closed without an answer"
            answer += piece
    assert answer.startswith(b"HTTP/1.1 413")  # controlplane.limits: refused before the body is read


def test_malformed_requests_are_refused(publisher: Publisher, cp_client: httpx.Client) -> None:
    """Not JSON, or missing the manifest: a 400 naming the field."""
    for body in (b"not json", b'{"labels": []}', b'{"manifest": "{}", "labels": ["bad label!"]}'):
        response = cp_client.post("/v1/uploads", content=body, headers=publisher.headers)
        assert response.status_code == 400, response.text


def test_pickle_files_need_an_explicit_allowance(
    publisher: Publisher, make_model: ModelMaker, cp_state: AppState
) -> None:
    """A .bin (pickle) file is refused unless the publisher allows pickle; then the model allows it for good."""
    root = make_model("m", tensors_mb=0.1, extra_files={"pytorch_model.bin": b"\x80\x04pickle"})
    manifest = publisher.manifest(root, "legacy", allow_pickle=True)
    refused = publisher.open(manifest)
    assert refused.status_code == 400
    assert "pickle" in problem(refused)["detail"]
    session = publisher.session(manifest, allow_pickle=True)
    publisher.upload(session, root, manifest)
    assert publisher.commit(session).status_code == 200
    with cp_state.sessions() as db:
        model = db.get(ModelRow, "legacy")
        assert model is not None
        assert model.allow_pickle
    again = make_model("m2", tensors_mb=0.1, seed=5, extra_files={"pytorch_model.bin": b"\x80\x04other"})
    assert publisher.open(publisher.manifest(again, "legacy", allow_pickle=True)).status_code == 201


def test_each_publish_route_admits_only_publishers(
    publisher: Publisher, make_model: ModelMaker, role_headers: dict[Role, dict[str, str]]
) -> None:
    """Every publish route needs the publisher (or admin) role: 401 without a token, 403 with another role."""
    manifest = publisher.manifest(make_model("m", tensors_mb=0.1), "llama")
    session = publisher.session(manifest)
    part = next(b for b in session.blobs if b.parts).parts[0]
    routes = [
        ("POST", "/v1/uploads", {"manifest": manifest.raw.decode(), "labels": []}),
        ("GET", f"/v1/uploads/{session.id}", None),
        ("PUT", part.url, None),
        ("POST", f"/v1/uploads/{session.id}/commit", None),
        ("DELETE", f"/v1/uploads/{session.id}", None),
    ]
    for method, path, body in routes:
        for role, status in ((None, 401), (Role.agent, 403), (Role.operator, 403)):
            headers = role_headers[role] if role else {}
            response = publisher.client.request(method, path, json=body, headers=headers)
            assert response.status_code == status, (method, path, role, response.text)
    for role in (Role.publisher, Role.admin):
        response = publisher.client.post("/v1/uploads", json=routes[0][2], headers=role_headers[role])
        assert response.status_code == 200, (role, response.text)


def test_part_uploads_must_name_a_part_of_the_session(publisher: Publisher, make_model: ModelMaker) -> None:
    """A part of a blob not in the manifest, or beyond its last chunk, is a 404; the right one a 204."""
    root = make_model("m", tensors_mb=0.1)
    manifest = publisher.manifest(root, "llama")
    session = publisher.session(manifest)
    blob = next(b for b in session.blobs if b.parts)
    data = (root / next(f.path for f in manifest.files if f.sha256 == blob.sha256)).read_bytes()
    for where, status in [
        ("blobs/{other}/parts/1", 404),
        ("blobs/{sha}/parts/0", 404),
        ("blobs/{sha}/parts/99", 404),
        ("blobs/{sha}/parts/1", 204),
    ]:
        url = f"/v1/uploads/{session.id}/" + where.format(sha=blob.sha256, other="0" * 64)
        response = publisher.client.put(url, content=data[: blob.parts[0].length], headers=publisher.headers)
        assert response.status_code == status, (where, response.text)


def test_unknown_sessions_are_not_found(publisher: Publisher) -> None:
    """Every session route answers 404 for a session that does not exist."""
    for method, path in (("GET", ""), ("POST", "/commit"), ("DELETE", "")):
        response = publisher.client.request(method, f"/v1/uploads/up_nope{path}", headers=publisher.headers)
        assert response.status_code == 404


def test_the_openapi_document_lists_the_publish_and_registry_routes(cp_client: httpx.Client) -> None:
    """Every publish and registry route is in the served OpenAPI document, with the upload body schema."""
    paths = cp_client.get("/openapi.json").json()["paths"]
    expected = {
        "/v1/uploads": {"post"},
        "/v1/uploads/{upload_id}": {"get", "delete"},
        "/v1/uploads/{upload_id}/blobs/{sha256}/parts/{number}": {"put"},
        "/v1/uploads/{upload_id}/commit": {"post"},
        "/v1/models": {"get"},
        "/v1/models/{model}/versions": {"get"},
        "/v1/models/{model}/versions/{ref}": {"get"},
        "/v1/models/{model}/versions/{ref}/manifest": {"get"},
        "/v1/models/{model}/labels": {"post"},
        "/v1/blobs/urls": {"post"},
        "/v1/blobs/{sha256}": {"get"},
    }
    assert {path: set(paths[path]) for path in expected} == expected
    body = paths["/v1/uploads"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {"manifest", "labels", "allow_pickle"}
