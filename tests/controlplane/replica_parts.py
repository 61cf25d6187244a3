"""Control-plane replicas as processes sharing one database, and versions seeded into it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.persistence.engine import make_engine, make_sessionmaker
from controlplane.persistence.rows import LabelRow, ModelRow, VersionRow, utcnow
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.controlplane.conftest import fake_digest

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def replicas(database_url: str, tmp_path: Path) -> Iterator[tuple[ControlPlaneProcess, ControlPlaneProcess]]:
    """Two control-plane processes on one fresh PostgreSQL database, both ready."""
    first = ControlPlaneProcess(tmp_path / "a", database_url=database_url)
    second = ControlPlaneProcess(tmp_path / "b", database_url=database_url)
    try:
        for replica in (first, second):
            replica.start()
        for replica in (first, second):
            replica.wait_ready()
        yield first, second
    finally:
        for replica in (first, second):
            replica.stop()


def seed(database_url: str, model: str, labels: tuple[str, ...]) -> dict[str, str]:
    """Ready versions of ``model`` straight in the database (publishing is not what is tested)."""
    engine = make_engine(database_url)
    digests = {label: fake_digest(model, label) for label in labels}
    try:
        with make_sessionmaker(engine)() as session:
            session.add(ModelRow(name=model, allow_pickle=False, created_at=utcnow()))
            session.flush()
            for label, digest in digests.items():
                session.add(VersionRow(digest=digest, model=model, size=1, files=1, manifest_size=1, state="ready",
                                       created_at=utcnow(), created_by="test"))  # fmt: skip
                session.flush()
                session.add(LabelRow(model=model, label=label, digest=digest, created_at=utcnow(), created_by="test"))
            session.commit()
    finally:
        engine.dispose()
    return digests


def set_stable(http: httpx.Client, label: str) -> None:
    """Move deployment ``chat`` to ``label`` (read the ETag, then compare-and-swap)."""
    etag = http.get("/v1/deployments/chat", headers=ADMIN).headers["etag"]
    response = http.put("/v1/deployments/chat/pointer", json={"stable": label}, headers={**ADMIN, "If-Match": etag})
    assert response.status_code == 200, response.text
