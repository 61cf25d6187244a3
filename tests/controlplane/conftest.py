"""Fixtures for control-plane tests (shared by the pointer/fleet and registry/publish suites).

- ``cp_settings``: ``Settings`` on the parametrised ``database_url`` (SQLite and PostgreSQL), a
  local-directory store under ``tmp_path`` and a known bootstrap admin token (``ADMIN_TOKEN``).
- ``live_controlplane``: the app served by a real uvicorn server on a loopback port, in a thread
  (lifespan run: migrated, admin bootstrapped); ``.url``, ``.app``, ``.state``.
- ``cp_client``: an ``httpx.Client`` for it (no auth header set by default). Real HTTP rather than
  Starlette's ``TestClient``, so concurrency and long-polls behave as in production.
- ``cp_state``: the running app's ``AppState`` (database sessions, settings, the pointer condition).
- ``admin_token`` / ``admin_headers``: the bootstrap admin's secret and ``Authorization`` header.
- ``role_headers``: ``Authorization`` headers for one fresh token per role (``test-<role>``).
- ``seed_versions``: inserts a model and ready versions straight into the database, for tests
  that need versions but not the publish flow; returns ``{label: digest}``.
- ``origin_settings``: like ``cp_settings`` but parametrised over the origin store: the local
  directory, and a fresh bucket on the moto S3 server (registry/publish suites override
  ``cp_settings`` with it).
- ``publisher``: drives the publish protocol over real HTTP, step by step (``Publisher``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from controlplane.app import create_app
from controlplane.auth import hash_secret, new_secret
from controlplane.persistence.rows import LabelRow, ModelRow, TokenRow, VersionRow, utcnow
from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.auth_parts import callers as callers  # a fixture for every test below this folder
from tests.controlplane.fleet_parts import agent as agent  # fixtures for every test below this folder
from tests.controlplane.fleet_parts import chat as chat
from tests.controlplane.fleet_parts import operator as operator
from tests.controlplane.fleet_parts import quiet_recheck as quiet_recheck
from weightship.manifest import Manifest, build_manifest
from weightship.schemas import PartUpload, Role, UploadSession, VersionInfo
from weightship.testing import problem as problem  # the control plane's tests import it from here
from weightship.testing import serve_in_thread

ADMIN_TOKEN = "ws_test-bootstrap-admin-0123456789abcdef"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

SeedVersions = Callable[..., dict[str, str]]


@pytest.fixture
def cp_settings(database_url: str, tmp_path: Path) -> Settings:
    """Settings of a control plane on a fresh database and a local store."""
    return Settings(
        database_url=database_url,
        store_url=f"local:{tmp_path / 'origin'}",
        admin_token=ADMIN_TOKEN,
        url_signing_key="test-signing-key-" + "0" * 47,
        public_url="http://testserver",
        node_stale_seconds=30.0,
        long_poll_max_seconds=30.0,
        # No background sampling of serving counters: tests that count queries stay exact; the
        # traffic tests take their samples themselves (controlplane.traffic.take_sample).
        serve_sample_seconds=3600.0,
    )


@pytest.fixture
def admin_token() -> str:
    """The bootstrap admin token's secret."""
    return ADMIN_TOKEN


@pytest.fixture
def admin_headers() -> dict[str, str]:
    """``Authorization`` header of the bootstrap admin."""
    return dict(ADMIN_HEADERS)


@pytest.fixture
def role_headers(cp_state: AppState) -> dict[Role, dict[str, str]]:
    """``Authorization`` headers per role: the bootstrap admin, and a token named ``test-<role>`` per other role.

    The tokens are written straight to the database (minting over the API is ``test_tokens``'s job)
    because nearly every test needs them and one transaction is cheaper than three requests.
    """
    headers = {Role.admin: ADMIN_HEADERS}
    with cp_state.sessions() as session:
        for role in (Role.publisher, Role.operator, Role.agent, Role.read):
            secret = new_secret()
            session.add(
                TokenRow(
                    id=f"test-{role.value}", name=f"test-{role.value}", role=role.value,
                    secret_hash=hash_secret(secret), revoked=False, created_at=utcnow(), created_by="test",
                )
            )  # fmt: skip
            headers[role] = {"Authorization": f"Bearer {secret}"}
        session.commit()
    return headers


def fake_digest(model: str, label: str) -> str:
    """A well-formed, deterministic version digest for seeded rows."""
    return "sha256:" + hashlib.sha256(f"{model}@{label}".encode()).hexdigest()


@pytest.fixture
def seed_versions(cp_state: AppState) -> SeedVersions:
    """``seed_versions(model, labels=("v1", "v2", "v3"), state="ready", size=1000)`` -> {label: digest}."""

    def seed(
        model: str, labels: tuple[str, ...] = ("v1", "v2", "v3"), state: str = "ready", size: int = 1000
    ) -> dict[str, str]:
        digests = {label: fake_digest(model, label) for label in labels}
        with cp_state.sessions() as session:
            if session.get(ModelRow, model) is None:
                session.add(ModelRow(name=model, allow_pickle=False, created_at=utcnow()))
                session.flush()
            for label, digest in digests.items():
                session.add(
                    VersionRow(
                        digest=digest, model=model, size=size, files=1, manifest_size=100,
                        state=state, created_at=utcnow(), created_by="test",
                    )
                )  # fmt: skip
                session.flush()
                session.add(LabelRow(model=model, label=label, digest=digest, created_at=utcnow(), created_by="test"))
            session.commit()
        return digests

    return seed


@dataclass(frozen=True)
class LiveControlPlane:
    """A control plane served over real HTTP on loopback."""

    url: str
    app: FastAPI

    @property
    def state(self) -> AppState:
        """The running app's state."""
        state: AppState = self.app.state.ws
        return state


@pytest.fixture
def live_controlplane(cp_settings: Settings) -> Iterator[LiveControlPlane]:
    """The app under uvicorn in a background thread, on a port the kernel picks."""
    app = create_app(cp_settings)
    with serve_in_thread(app, lifespan="on", limit_concurrency=500) as url:
        yield LiveControlPlane(url=url, app=app)


@pytest.fixture
def cp_client(live_controlplane: LiveControlPlane) -> Iterator[httpx.Client]:
    """An HTTP client for the live control plane (no auth header by default)."""
    with httpx.Client(base_url=live_controlplane.url, timeout=30) as client:
        yield client


@pytest.fixture
def cp_state(live_controlplane: LiveControlPlane) -> AppState:
    """The live control plane's ``AppState``."""
    return live_controlplane.state


# --- registry and publish suites --------------------------------------------------------------

TEST_CHUNK = 64 * 1024


@pytest.fixture(params=["local", "s3"])
def origin_settings(request: pytest.FixtureRequest, database_url: str, tmp_path: Path) -> Settings:
    """``Settings`` on the parametrised database and origin store (local directory, or moto S3)."""
    store_url = f"local:{tmp_path / 'origin'}"
    endpoint = ""
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        # moto allows 64 KiB parts (S3_UPLOAD_PART_MIN_SIZE); short timeouts keep failures fast.
        store_url = f"s3://{bucket}/origin?min_part_size=65536&attempts=2&backoff=0.01&read_timeout=10"
    return Settings(
        database_url=database_url,
        store_url=store_url,
        s3_endpoint_url=endpoint,
        admin_token=ADMIN_TOKEN,
        url_signing_key="test-signing-key-" + "1" * 47,
        public_url="http://testserver",
        upload_ttl_seconds=3600,
        blob_url_ttl_seconds=300,
    )


class Publisher:
    """The client side of the publish protocol, one step per method, over real HTTP."""

    def __init__(self, client: httpx.Client, headers: dict[str, str]) -> None:
        self.client = client
        self.headers = headers
        self.direct = httpx.Client(timeout=30)

    def manifest(self, root: Path, model: str, allow_pickle: bool = False) -> Manifest:
        """The manifest of ``root`` at the test chunk size."""
        return build_manifest(root, model, chunk_size=TEST_CHUNK, allow_pickle=allow_pickle)

    def open(
        self, manifest: Manifest | bytes, labels: tuple[str, ...] = (), allow_pickle: bool = False
    ) -> httpx.Response:
        """``POST /v1/uploads``."""
        raw = manifest if isinstance(manifest, bytes) else manifest.raw
        body = {"manifest": raw.decode("utf-8"), "labels": list(labels), "allow_pickle": allow_pickle}
        return self.client.post("/v1/uploads", json=body, headers=self.headers)

    def session(self, manifest: Manifest, labels: tuple[str, ...] = (), allow_pickle: bool = False) -> UploadSession:
        """Open (or resume) and parse the session."""
        response = self.open(manifest, labels, allow_pickle)
        assert response.status_code in (200, 201), response.text
        return UploadSession.model_validate_json(response.content)

    def put(self, part: PartUpload, data: bytes) -> httpx.Response:
        """PUT one part where the session says: presigned URL (no token) or this API (token)."""
        if part.url.startswith(("http://", "https://")):
            return self.direct.put(part.url, content=data, headers=part.headers)
        return self.client.put(part.url, content=data, headers={**part.headers, **self.headers})

    def upload(
        self,
        session: UploadSession,
        root: Path,
        manifest: Manifest,
        only: Callable[[str, PartUpload], bool] | None = None,
    ) -> int:
        """Upload every part not done (or those ``only`` picks); returns the bytes sent."""
        paths = {f.sha256: root / f.path for f in manifest.files}
        sent = 0
        for blob in session.blobs:
            for part in blob.parts:
                if part.done or (only is not None and not only(blob.sha256, part)):
                    continue
                with open(paths[blob.sha256], "rb") as handle:
                    handle.seek(part.offset)
                    data = handle.read(part.length)
                response = self.put(part, data)
                assert response.status_code in (200, 204), response.text
                sent += len(data)
        return sent

    def commit(self, session: UploadSession) -> httpx.Response:
        """``POST /v1/uploads/{id}/commit``."""
        return self.client.post(f"/v1/uploads/{session.id}/commit", headers=self.headers)

    def publish(self, root: Path, model: str, labels: tuple[str, ...] = ()) -> tuple[UploadSession, VersionInfo]:
        """The whole protocol: open, upload what is missing, commit."""
        manifest = self.manifest(root, model)
        session = self.session(manifest, labels)
        self.upload(session, root, manifest)
        response = self.commit(session)
        assert response.status_code == 200, response.text
        return session, VersionInfo.model_validate_json(response.content)


@pytest.fixture
def publisher(cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]]) -> Iterator[Publisher]:
    """A ``Publisher`` holding a publisher token."""
    pub = Publisher(cp_client, role_headers[Role.publisher])
    yield pub
    pub.direct.close()


# Imported last: the module imports this conftest.
from tests.controlplane.replica_parts import replicas as replicas  # noqa: E402 - a fixture for every test below this folder
