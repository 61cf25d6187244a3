"""Publishing over REST, end to end: a real control plane over HTTP, on every store and database.

Each test runs four ways: the local-directory store and moto's S3 server, on SQLite and on
PostgreSQL (``database_url``). Parts go where the session says: presigned S3 URLs straight to
moto, or the control plane's part route for the local store.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import httpx
import pytest
from sqlalchemy import update

from controlplane.persistence.rows import UploadSessionRow
from controlplane.persistence.store import LocalStore, S3Store
from controlplane.publish import sweep_expired_uploads
from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from weightship.manifest import canonical_json
from weightship.schemas import UploadSession, VersionInfo

if TYPE_CHECKING:
    from tests.conftest import ModelMaker
    from tests.controlplane.conftest import Publisher

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cp_settings(origin_settings: Settings) -> Settings:
    """This suite runs on both origin stores."""
    return origin_settings


def test_a_published_version_is_ready_and_its_manifest_is_stored_exactly(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client, cp_state: AppState
) -> None:
    """Open, upload, commit: the version is ready under its label and the manifest reads back byte-exact."""
    root = make_model("m1", tensors_mb=0.3)
    manifest = publisher.manifest(root, "llama")
    session, version = publisher.publish(root, "llama", ("v1",))
    assert session.bytes_missing == session.bytes_total == manifest.total_size
    blob = session.blobs[0]
    if cp_state.store.kind == "s3":  # straight to S3, carrying the chunk's checksum
        assert blob.method == "s3-multipart"
        assert blob.parts[0].url.startswith(cp_state.settings.s3_endpoint_url)
        assert set(blob.parts[0].headers) == {"x-amz-checksum-sha256"}
    else:  # through the control plane, which hashes each part before keeping it
        assert blob.method == "http-put"
        assert blob.parts[0].url == f"/v1/uploads/{session.id}/blobs/{blob.sha256}/parts/1"
    assert (version.digest, version.labels, version.state) == (manifest.digest, ["v1"], "ready")
    assert (version.size, version.files) == (manifest.total_size, len(manifest.files))
    response = cp_client.get("/v1/models/llama/versions/v1/manifest", headers=publisher.headers)
    assert response.content == manifest.raw
    assert response.headers["etag"] == f'"{manifest.digest}"'


def test_identical_content_gets_the_same_version_and_uploads_nothing(
    publisher: Publisher, make_model: ModelMaker
) -> None:
    """Publishing the same bytes again: nothing to upload, the same digest, and the new label added."""
    root = make_model("m1", tensors_mb=0.3)
    _, first = publisher.publish(root, "llama", ("v1",))
    manifest = publisher.manifest(root, "llama")
    again = publisher.session(manifest, ("v1-again",))
    assert again.bytes_missing == 0
    assert all(blob.present and not blob.parts for blob in again.blobs)
    response = publisher.commit(again)
    assert response.status_code == 200, response.text
    second = VersionInfo.model_validate_json(response.content)
    assert second.digest == first.digest
    assert sorted(second.labels) == ["v1", "v1-again"]
    repeated = publisher.commit(again)
    assert repeated.status_code == 200, "commit is idempotent: a lost answer can be asked for again"
    assert VersionInfo.model_validate_json(repeated.content) == second


def test_a_new_version_uploads_only_the_blobs_the_store_lacks(publisher: Publisher, make_model: ModelMaker) -> None:
    """v2 shares its weights with v1: only the changed file is uploaded."""
    v1 = make_model("v1", tensors_mb=0.3, seed=1)
    v2 = make_model("v2", tensors_mb=0.3, seed=1, extra_files={"generation_config.json": b'{"top_p": 0.9}'})
    publisher.publish(v1, "llama", ("v1",))
    manifest = publisher.manifest(v2, "llama")
    session = publisher.session(manifest, ("v2",))
    missing = {blob.sha256 for blob in session.blobs if not blob.present}
    assert missing == {manifest.file("generation_config.json").sha256}
    assert publisher.upload(session, v2, manifest) == session.bytes_missing == 14
    assert publisher.commit(session).status_code == 200


def test_an_interrupted_publish_resumes_where_it_stopped(publisher: Publisher, make_model: ModelMaker) -> None:
    """Reopening the same manifest returns the open session with the parts already sent marked done."""
    root = make_model("m1", tensors_mb=0.3)
    manifest = publisher.manifest(root, "llama")
    first = publisher.session(manifest, ("v1",))
    sent = publisher.upload(first, root, manifest, only=lambda _sha, part: part.number == 1)
    assert sent > 0
    response = publisher.open(manifest, ("v1",))
    assert response.status_code == 200, response.text
    resumed = UploadSession.model_validate_json(response.content)
    assert resumed.id == first.id
    assert resumed.bytes_missing == first.bytes_missing - sent
    assert all(part.done == (part.number == 1) for blob in resumed.blobs for part in blob.parts)
    assert publisher.upload(resumed, root, manifest) == resumed.bytes_missing
    assert publisher.commit(resumed).status_code == 200


def test_a_chunk_that_does_not_match_makes_nothing_ready(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client
) -> None:
    """Wrong bytes for a part: refused on arrival (local) or at commit (S3); either way no version, until fixed."""
    root = make_model("m1", tensors_mb=0.3)
    manifest = publisher.manifest(root, "llama")
    session = publisher.session(manifest, ("v1",))
    victim = next(blob for blob in session.blobs if len(blob.parts) > 1).parts[1]
    publisher.upload(session, root, manifest, only=lambda _sha, part: part is not victim)
    bad = publisher.put(victim, b"\0" * victim.length)
    assert bad.status_code in (200, 422), bad.text
    commit = publisher.commit(session)
    assert commit.status_code == (422 if bad.status_code == 200 else 409), commit.text
    assert problem(commit)["code"] == ("integrity" if bad.status_code == 200 else "conflict")
    assert cp_client.get(f"/v1/models/llama/versions/{manifest.digest}", headers=publisher.headers).status_code == 404
    fixed = publisher.session(manifest, ("v1",))
    assert fixed.id == session.id
    publisher.upload(fixed, root, manifest)
    assert publisher.commit(fixed).status_code == 200


def test_a_truncated_part_is_refused(publisher: Publisher, make_model: ModelMaker) -> None:
    """A part shorter than its chunk: 422 on arrival (local) or at commit (S3)."""
    root = make_model("m1", tensors_mb=0.3)
    manifest = publisher.manifest(root, "llama")
    session = publisher.session(manifest)
    victim = next(blob for blob in session.blobs if len(blob.parts) > 1).parts[0]
    publisher.upload(session, root, manifest, only=lambda _sha, part: part is not victim)
    with open(root / "model.safetensors", "rb") as handle:
        short = handle.read(victim.length - 1000)
    put = publisher.put(victim, short)
    if put.status_code == 422:
        assert "truncated" in problem(put)["detail"]
        assert publisher.commit(session).status_code == 409
    else:
        commit = publisher.commit(session)
        assert commit.status_code == 422, commit.text
        assert "bytes, expected" in problem(commit)["detail"]


def test_a_label_never_moves_to_other_content(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client
) -> None:
    """A label already naming a version is refused for different content, at open and on POST labels (409)."""
    _, v1 = publisher.publish(make_model("a", seed=1, tensors_mb=0.1), "llama", ("prod",))
    _, v2 = publisher.publish(make_model("b", seed=2, tensors_mb=0.1), "llama", ("v2",))
    other = publisher.manifest(make_model("c", seed=3, tensors_mb=0.1), "llama")
    response = publisher.open(other, ("prod",))
    assert response.status_code == 409
    assert "never move" in problem(response)["detail"]
    relabel = cp_client.post(
        "/v1/models/llama/labels", json={"label": "prod", "digest": v2.digest}, headers=publisher.headers
    )
    assert relabel.status_code == 409
    current = cp_client.get("/v1/models/llama/versions/prod", headers=publisher.headers).json()
    assert current["digest"] == v1.digest


def test_abandoned_sessions_expire_and_their_uploads_are_discarded(
    publisher: Publisher, make_model: ModelMaker, cp_state: AppState
) -> None:
    """Past expires_at, a sweep aborts the store uploads; the session can no longer be committed."""
    now = [datetime.now(UTC)]
    cp_state.clock = lambda: now[0]
    root = make_model("m1", tensors_mb=0.3)
    manifest = publisher.manifest(root, "llama")
    session = publisher.session(manifest)
    publisher.upload(session, root, manifest, only=lambda _sha, part: part.number == 1)
    assert _open_uploads(cp_state) > 0
    now[0] += timedelta(seconds=cp_state.settings.upload_ttl_seconds - 1)
    assert sweep_expired_uploads(cp_state) == 0
    now[0] += timedelta(seconds=2)
    assert sweep_expired_uploads(cp_state) == 1
    assert _open_uploads(cp_state) == 0
    commit = publisher.commit(session)
    assert commit.status_code == 409
    state = publisher.client.get(f"/v1/uploads/{session.id}", headers=publisher.headers).json()["state"]
    assert state == "aborted"
    fresh = publisher.session(manifest)
    assert fresh.id != session.id


def _open_uploads(state: AppState) -> int:
    """Multipart uploads (S3) or staging directories (local) the store still holds."""
    store = state.store
    if isinstance(store, S3Store):
        return len(store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []))
    assert isinstance(store, LocalStore)
    return len(list((store.root / "staging").iterdir()))


def test_deleting_a_session_discards_its_uploads(
    publisher: Publisher, make_model: ModelMaker, cp_state: AppState
) -> None:
    """DELETE aborts the store uploads; deleting again is harmless; commit is then refused."""
    root = make_model("m1", tensors_mb=0.1)
    session = publisher.session(publisher.manifest(root, "llama"))
    assert _open_uploads(cp_state) > 0
    for _ in range(2):
        assert publisher.client.delete(f"/v1/uploads/{session.id}", headers=publisher.headers).status_code == 204
    assert _open_uploads(cp_state) == 0
    assert publisher.commit(session).status_code == 409


def test_a_manifest_that_contradicts_a_stored_blob_is_refused(publisher: Publisher, make_model: ModelMaker) -> None:
    """Claiming a stored blob's digest for other chunks is refused (422), not deduplicated into a bad version."""
    stored = publisher.manifest(make_model("a", seed=1, tensors_mb=0.3), "llama")
    publisher.publish(make_model("a", seed=1, tensors_mb=0.3), "llama", ("v1",))
    doc = json.loads(publisher.manifest(make_model("b", seed=2, tensors_mb=0.3), "llama").raw)
    weights = next(f for f in doc["files"] if f["path"] == "model.safetensors")
    weights["sha256"] = stored.file("model.safetensors").sha256  # same size, other bytes
    response = publisher.open(canonical_json(doc))
    assert response.status_code == 422, response.text
    assert "differ from this manifest" in problem(response)["detail"]


def test_a_session_shows_verifying_during_a_commit_and_a_second_commit_is_refused(
    publisher: Publisher, make_model: ModelMaker, cp_state: AppState
) -> None:
    """While a commit checks the blobs the session reads ``verifying``; another commit then is a 409, not a race."""
    root = make_model("m1", tensors_mb=0.1)
    manifest = publisher.manifest(root, "llama")
    session = publisher.session(manifest, ("v1",))
    publisher.upload(session, root, manifest)

    def set_state(state: str) -> None:
        with cp_state.sessions() as db:
            db.execute(update(UploadSessionRow).where(UploadSessionRow.id == session.id).values(state=state))
            db.commit()

    set_state("verifying")  # as a commit running in another request leaves it
    shown = publisher.client.get(f"/v1/uploads/{session.id}", headers=publisher.headers).json()
    assert shown["state"] == "verifying"
    second = publisher.commit(session)
    assert second.status_code == 409, second.text
    assert "verifying" in problem(second)["detail"]
    set_state("open")
    assert publisher.commit(session).status_code == 200
