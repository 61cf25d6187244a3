"""Registry routes: models, versions, manifests, labels and blob read URLs, on both stores and databases."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx
import pytest

from controlplane.persistence.store import LocalStore, S3Store, manifest_key
from controlplane.persistence.store.signing import sign_blob
from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from weightship.schemas import BlobURLs, Role, VersionInfo

if TYPE_CHECKING:
    from tests.conftest import ModelMaker
    from tests.controlplane.conftest import Publisher

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cp_settings(origin_settings: Settings) -> Settings:
    """This suite runs on both origin stores."""
    return origin_settings


@pytest.fixture
def two_versions(publisher: Publisher, make_model: ModelMaker) -> tuple[VersionInfo, VersionInfo]:
    """v1 and v2 of model ``llama``, v2 published last."""
    _, v1 = publisher.publish(make_model("a", seed=1, tensors_mb=0.2), "llama", ("v1",))
    _, v2 = publisher.publish(make_model("b", seed=2, tensors_mb=0.2), "llama", ("v2", "latest"))
    return v1, v2


def test_models_and_versions_are_listed_with_their_labels(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], two_versions: tuple[VersionInfo, VersionInfo]
) -> None:
    """Any role (but an enrolment token) reads the index: models with counts, versions newest first, with labels."""
    v1, v2 = two_versions
    agent = role_headers[Role.operator]
    models = cp_client.get("/v1/models", headers=agent).json()
    assert [(m["name"], m["versions"]) for m in models] == [("llama", 2)]
    versions = [VersionInfo.model_validate(v) for v in cp_client.get("/v1/models/llama/versions", headers=agent).json()]
    assert [v.digest for v in versions] == [v2.digest, v1.digest]
    assert versions[0].labels == ["latest", "v2"]
    for ref, digest in (("v1", v1.digest), ("latest", v2.digest), (v1.digest, v1.digest)):
        response = cp_client.get(f"/v1/models/llama/versions/{ref}", headers=agent)
        assert response.json()["digest"] == digest


BAD_REFERENCES = [
    ("/v1/models/nope/versions", 404),
    ("/v1/models/llama/versions/v9", 404),
    ("/v1/models/llama/versions/sha256:" + "0" * 64, 404),
    ("/v1/models/llama/versions/sha256:XYZ", 400),
    ("/v1/models/Bad%20Name/versions", 400),
]


def test_unknown_or_malformed_references_are_clear_errors(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], two_versions: tuple[VersionInfo, VersionInfo]
) -> None:
    """A model, label or digest that does not exist is a 404; a malformed one a 400; both say which."""
    for path, status in BAD_REFERENCES:
        response = cp_client.get(path, headers=role_headers[Role.operator])
        assert response.status_code == status, (path, response.text)
        assert problem(response)["detail"], path


def test_the_manifest_is_served_exactly_as_stored(
    cp_client: httpx.Client, publisher: Publisher, make_model: ModelMaker
) -> None:
    """Manifest bytes come back byte-exact with ETag = digest; a matching If-None-Match gets 304."""
    root = make_model("a", tensors_mb=0.1)
    manifest = publisher.manifest(root, "llama")
    publisher.publish(root, "llama", ("v1",))
    for ref in ("v1", manifest.digest):
        response = cp_client.get(f"/v1/models/llama/versions/{ref}/manifest", headers=publisher.headers)
        assert response.content == manifest.raw
        assert response.headers["etag"] == f'"{manifest.digest}"'
    cached = cp_client.get(
        "/v1/models/llama/versions/v1/manifest", headers={**publisher.headers, "If-None-Match": f'"{manifest.digest}"'}
    )
    assert cached.status_code == 304


def test_a_corrupted_stored_manifest_is_never_served(
    cp_client: httpx.Client, publisher: Publisher, make_model: ModelMaker, cp_state: AppState
) -> None:
    """Bytes in the store that no longer hash to the digest are an integrity error, not a response."""
    _, version = publisher.publish(make_model("a", tensors_mb=0.1), "llama", ("v1",))
    key = manifest_key(version.digest)
    store = cp_state.store
    if isinstance(store, S3Store):
        store.client.put_object(Bucket=store.bucket, Key=store.prefix + key, Body=b'{"tampered":true}')
    else:
        assert isinstance(store, LocalStore)
        (store.root / key).write_bytes(b'{"tampered":true}')
    response = cp_client.get("/v1/models/llama/versions/v1/manifest", headers=publisher.headers)
    assert response.status_code == 422
    assert "corrupt" in problem(response)["detail"]


def test_labels_are_added_once_and_never_moved(
    cp_client: httpx.Client, publisher: Publisher, two_versions: tuple[VersionInfo, VersionInfo]
) -> None:
    """A new label is 201, the same label on the same digest 200, on another digest 409."""
    v1, v2 = two_versions

    def label(name: str, digest: str) -> httpx.Response:
        return cp_client.post(
            "/v1/models/llama/labels", json={"label": name, "digest": digest}, headers=publisher.headers
        )

    assert label("prod", v1.digest).status_code == 201
    again = label("prod", v1.digest)
    assert again.status_code == 200
    assert sorted(again.json()["labels"]) == ["prod", "v1"]
    moved = label("prod", v2.digest)
    assert moved.status_code == 409
    assert "never move" in problem(moved)["detail"]
    assert label("v1", v2.digest).status_code == 409
    assert label("ghost", "sha256:" + "0" * 64).status_code == 404


ROUTE_ROLES = [
    ("POST", "/v1/models/llama/labels", None, 401),
    ("POST", "/v1/models/llama/labels", Role.agent, 403),
    ("POST", "/v1/models/llama/labels", Role.operator, 403),
    ("POST", "/v1/models/llama/labels", Role.publisher, 201),
    ("POST", "/v1/blobs/urls", None, 401),
    ("POST", "/v1/blobs/urls", Role.publisher, 403),
    ("POST", "/v1/blobs/urls", Role.operator, 200),
    ("POST", "/v1/blobs/urls", Role.agent, 403),  # an enrolment token enrols, nothing else
    ("POST", "/v1/blobs/urls", Role.admin, 200),
    ("GET", "/v1/models", None, 401),
    ("GET", "/v1/models", Role.agent, 403),
    ("GET", "/v1/models/llama/versions", Role.publisher, 200),
    ("GET", "/v1/models/llama/versions/v1", Role.operator, 200),
    ("GET", "/v1/models/llama/versions/v1/manifest", None, 401),
    ("GET", "/v1/models/llama/versions/v1/manifest", Role.agent, 403),
    ("GET", "/v1/models/llama/versions/v1/manifest", Role.operator, 200),
]


def test_each_registry_route_admits_only_its_roles(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]], two_versions: tuple[VersionInfo, VersionInfo]
) -> None:
    """Reads: any role but an enrolment token. Labels: publisher. Blob URLs: a node token or operator. Admin: all."""
    for index, (method, path, role, status) in enumerate(ROUTE_ROLES):
        body: dict[str, object] | None = None
        if path.endswith("/labels"):
            body = {"label": f"x{index}", "digest": two_versions[0].digest}
        elif path.endswith("/urls"):
            body = {"blobs": ["a" * 64]}
        headers = role_headers[role] if role else {}
        response = cp_client.request(method, path, json=body, headers=headers)
        assert response.status_code == status, (method, path, role, response.text)


def _reachable(url: str, settings: Settings, client: httpx.Client) -> str:
    """Blob URLs name ``public_url``; in tests that is the live server's address."""
    return url.replace(settings.public_url, str(client.base_url).rstrip("/"), 1)


def test_blob_urls_serve_whole_blobs_and_ranges_without_a_token(
    cp_client: httpx.Client,
    role_headers: dict[Role, dict[str, str]],
    publisher: Publisher,
    make_model: ModelMaker,
    cp_state: AppState,
) -> None:
    """A node entitled to the version gets short-lived URLs; they need no token and answer HTTP range requests."""
    root = make_model("a", tensors_mb=0.2)
    manifest = publisher.manifest(root, "llama")
    publisher.publish(root, "llama", ("v1",))
    blobs = [f.sha256 for f in manifest.files]
    operator = role_headers[Role.operator]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=operator).is_success
    etag = cp_client.get("/v1/deployments/chat", headers=operator).headers["etag"]
    pointed = cp_client.put("/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={**operator, "If-Match": etag})
    assert pointed.status_code == 200, pointed.text
    enrolled = cp_client.post("/v1/nodes/enrol", json={"name": "gpu-1", "deployments": ["chat"]},
                              headers=role_headers[Role.agent])  # fmt: skip
    node = {"Authorization": f"Bearer {enrolled.json()['token']}"}
    response = cp_client.post("/v1/blobs/urls", json={"blobs": blobs}, headers=node)
    assert response.status_code == 200, response.text
    urls = BlobURLs.model_validate_json(response.content).urls
    assert set(urls) == set(blobs)
    with httpx.Client(timeout=30) as anonymous:
        for entry in manifest.files:
            url = _reachable(urls[entry.sha256].url, cp_state.settings, cp_client)
            data = (root / entry.path).read_bytes()
            assert anonymous.get(url).content == data
            ranged = anonymous.get(url, headers={"Range": "bytes=10-4105"})
            assert ranged.status_code == 206
            assert ranged.content == data[10:4106]
    assert min(u.expires_at.timestamp() for u in urls.values()) > time.time() + 250


def test_signed_blob_urls_are_checked(
    cp_client: httpx.Client, publisher: Publisher, make_model: ModelMaker, cp_state: AppState
) -> None:
    """On the local store: a tampered or expired signature is a 403; a good one serves the blob (also HEAD)."""
    if cp_state.store.kind != "local":
        pytest.skip("S3 serves blobs itself on presigned URLs")
    root = make_model("a", tensors_mb=0.1)
    sha = publisher.manifest(root, "llama").file("config.json").sha256
    publisher.publish(root, "llama", ("v1",))
    key = cp_state.settings.url_signing_key
    later, earlier = int(time.time()) + 60, int(time.time()) - 1
    good = sign_blob(key, sha, later)
    tampered = good[:-1] + ("1" if good[-1] == "0" else "0")
    cases = [
        (later, good, 200),
        (later, tampered, 403),
        (later + 1, sign_blob(key, sha, later), 403),
        (earlier, sign_blob(key, sha, earlier), 403),
        (later, sign_blob("another key", sha, later), 403),
    ]
    for expires, sig, status in cases:
        response = cp_client.get(f"/v1/blobs/{sha}", params={"expires": expires, "sig": sig})
        assert response.status_code == status, (expires, sig, response.text)
    head = cp_client.head(f"/v1/blobs/{sha}", params={"expires": later, "sig": sign_blob(key, sha, later)})
    assert head.status_code == 200
    assert int(head.headers["content-length"]) == (root / "config.json").stat().st_size
