"""Disaster recovery: the version index rebuilt from the origin store alone, on both stores and databases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import delete, select

from controlplane.persistence.engine import make_engine, make_sessionmaker
from controlplane.persistence.rows import LabelRow, ModelRow, UploadSessionRow, VersionRow
from controlplane.persistence.store import LocalStore, S3Store, blob_key, manifest_key
from controlplane.recovery import main as recovery_main
from controlplane.recovery import rebuild_index
from controlplane.settings import Settings
from controlplane.state import AppState
from weightship.errors import ConflictError
from weightship.schemas import VersionInfo

if TYPE_CHECKING:
    from tests.conftest import ModelMaker
    from tests.controlplane.conftest import Publisher

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cp_settings(origin_settings: Settings) -> Settings:
    """This suite runs on both origin stores."""
    return origin_settings


@pytest.fixture
def published(publisher: Publisher, make_model: ModelMaker, cp_client: Any) -> list[VersionInfo]:
    """Two models, three versions, labels set at publish and afterwards."""
    _, a1 = publisher.publish(make_model("a1", seed=1, tensors_mb=0.1), "llama", ("v1",))
    _, a2 = publisher.publish(make_model("a2", seed=2, tensors_mb=0.1), "llama", ("v2",))
    _, b1 = publisher.publish(make_model("b1", seed=3, tensors_mb=0.1), "mistral", ("2026-11-29.1",))
    response = cp_client.post(
        "/v1/models/llama/labels", json={"label": "prod", "digest": a1.digest}, headers=publisher.headers
    )
    assert response.status_code == 201
    return [a1, a2, b1]


def snapshot(state: AppState) -> dict[str, Any]:
    """Everything the index holds, comparable across a rebuild."""
    with state.sessions() as session:
        return {
            "models": sorted((m.name, m.allow_pickle) for m in session.scalars(select(ModelRow))),
            "versions": sorted(
                (v.digest, v.model, v.size, v.files, v.manifest_size, v.state, v.created_by)
                for v in session.scalars(select(VersionRow))
            ),
            "labels": sorted(
                (lb.model, lb.label, lb.digest, lb.created_by) for lb in session.scalars(select(LabelRow))
            ),
        }


def lose_the_index(state: AppState) -> None:
    """What a lost database looks like to the index: no models, versions, labels or sessions."""
    with state.sessions() as session:
        for table in (LabelRow, VersionRow, UploadSessionRow, ModelRow):
            session.execute(delete(table))
        session.commit()


def test_the_index_is_rebuilt_from_the_store_alone(cp_state: AppState, published: list[VersionInfo]) -> None:
    """Models, versions (with provenance) and labels come back exactly, from the bucket only; only into an empty database."""
    before = snapshot(cp_state)
    with pytest.raises(ConflictError, match="empty database"):
        rebuild_index(cp_state.store, cp_state.sessions)
    lose_the_index(cp_state)
    report = rebuild_index(cp_state.store, cp_state.sessions)
    assert (report.models, report.versions, report.labels, report.skipped) == (2, 3, 4, [])
    assert snapshot(cp_state) == before


def test_versions_whose_blobs_are_gone_are_reported_not_recovered(
    cp_state: AppState, published: list[VersionInfo], make_model: ModelMaker, publisher: Publisher
) -> None:
    """A version missing a blob is skipped and named; its labels are skipped with it."""
    lost = publisher.manifest(make_model("b1", seed=3, tensors_mb=0.1), "mistral")
    store = cp_state.store
    sha = lost.file("model.safetensors").sha256
    if isinstance(store, S3Store):
        store.client.delete_object(Bucket=store.bucket, Key=store.prefix + blob_key(sha))
    else:
        assert isinstance(store, LocalStore)
        store.blob_path(sha).unlink()
    lose_the_index(cp_state)
    report = rebuild_index(store, cp_state.sessions)
    assert (report.versions, report.labels) == (2, 3)
    assert any(lost.digest in problem and "blobs missing" in problem for problem in report.skipped)
    assert any("labels/mistral/2026-11-29.1" in problem for problem in report.skipped)


def test_the_recovery_command_rebuilds_into_a_fresh_database(
    cp_state: AppState, published: list[VersionInfo], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command migrates an empty database, rebuilds it, prints one JSON line; a second run is refused."""
    settings = cp_state.settings
    target = f"sqlite:///{tmp_path / 'recovered.db'}"
    argv = ["--store", settings.store_url, "--database", target, "--s3-endpoint-url", settings.s3_endpoint_url]
    assert recovery_main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["models"], summary["versions"], summary["labels"]) == (2, 3, 4)
    engine = make_engine(target)
    try:
        with make_sessionmaker(engine)() as session:
            assert sorted(session.scalars(select(VersionRow.digest))) == sorted(v.digest for v in published)
            assert session.get(LabelRow, ("llama", "prod")) is not None
    finally:
        engine.dispose()
    assert recovery_main(argv) == 2
    assert "empty database" in capsys.readouterr().err


def test_recovery_runs_as_a_module(tmp_path: Path) -> None:
    """``python -m controlplane.recovery`` is a real command: an empty store recovers into an empty database."""
    command = [
        sys.executable,
        "-m",
        "controlplane.recovery",
        "--store",
        f"local:{tmp_path / 'origin'}",
        "--database",
        f"sqlite:///{tmp_path / 'db.sqlite'}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == {"event": "recovered", "labels": 0, "models": 0, "skipped": [], "versions": 0}


def test_a_manifest_whose_bytes_do_not_hash_to_its_key_is_skipped(
    cp_state: AppState, published: list[VersionInfo]
) -> None:
    """Tampered manifest bytes never become a version: the one manifest-bytes check refuses them."""
    store = cp_state.store
    key = manifest_key(published[2].digest)
    raw = store.get_bytes(key, 1 << 20)
    if isinstance(store, S3Store):
        store.client.put_object(Bucket=store.bucket, Key=store.prefix + key, Body=raw + b" ")
    else:
        assert isinstance(store, LocalStore)
        (store.root / key).write_bytes(raw + b" ")
    lose_the_index(cp_state)
    report = rebuild_index(store, cp_state.sessions)
    assert report.versions == 2
    assert any(key in problem and "corrupt manifest" in problem for problem in report.skipped)
