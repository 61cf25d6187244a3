"""Commit-side integrity: no version becomes ready on bytes nobody verified, and no blob name is squatted.

Threat: a publisher (holding only a publisher token) tries to make the registry hold a "ready"
version whose chunk digests describe other bytes than the blob it names, or to plant bytes under
a blob name they do not hash to. Each test runs against a real control plane over HTTP, on the
local-directory store and on moto's S3 server (a separate process), on SQLite and PostgreSQL.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from sqlalchemy import select

from controlplane.persistence.rows import BlobChunksRow, UploadSessionRow
from controlplane.persistence.store import S3Store
from controlplane.persistence.store.origin import UPLOADS
from controlplane.settings import Settings
from controlplane.state import AppState
from tests.controlplane.conftest import TEST_CHUNK, problem
from weightship.manifest import Manifest, build_manifest, canonical_json
from weightship.schemas import UploadSession

if TYPE_CHECKING:
    from tests.conftest import ModelMaker
    from tests.controlplane.conftest import Publisher

pytestmark = pytest.mark.timeout(120)

WEIGHTS = "model.safetensors"


@pytest.fixture
def cp_settings(origin_settings: Settings) -> Settings:
    """Both origin stores."""
    return origin_settings


def forged(manifest: Manifest, edit: Any) -> bytes:
    """``manifest``'s document after ``edit(weights entry)``, as canonical bytes (a well-formed lie)."""
    doc = json.loads(manifest.raw)
    edit(next(f for f in doc["files"] if f["path"] == WEIGHTS))
    return canonical_json(doc)


def fake_digest(n: int) -> str:
    """A made-up chunk digest."""
    return hashlib.sha256(f"made-up chunk {n}".encode()).hexdigest()


def version_status(client: httpx.Client, headers: dict[str, str], digest: str) -> int:
    """HTTP status of ``GET`` the version: 200 ready, 404 absent."""
    return client.get(f"/v1/models/llama/versions/sha256:{digest.removeprefix('sha256:')}", headers=headers).status_code


def chunk_lists(state: AppState, sha: str) -> dict[int, list[str]]:
    """The verified chunk lists recorded for blob ``sha``, by chunk size."""
    with state.sessions() as session:
        rows = session.scalars(select(BlobChunksRow).where(BlobChunksRow.sha256 == sha)).all()
    return {row.chunk_size: list(row.chunks) for row in rows}


def test_rechunking_a_stored_blob_with_made_up_chunk_digests_is_refused_at_commit(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client, cp_state: AppState
) -> None:
    """The poisoning sequence: v1 published; a manifest naming v1's blob at another chunk size with fake digests.

    Nothing needs uploading (the blob is stored), so only hashing the stored bytes under the new
    geometry can catch it: commit is a 422 naming the file, blob and first differing chunk; the
    version is never ready and no chunk list is recorded for that geometry. The same files honestly
    re-chunked then commit fine, verified by the same hashing.
    """
    root = make_model("m", tensors_mb=0.3, seed=7)
    _, v1 = publisher.publish(root, "llama", ("v1",))
    weights = publisher.manifest(root, "llama").file(WEIGHTS)
    assert chunk_lists(cp_state, weights.sha256) == {TEST_CHUNK: list(weights.chunks)}

    bigger = 2 * TEST_CHUNK
    honest = build_manifest(root, "llama", chunk_size=bigger)
    assert len(honest.file(WEIGHTS).chunks) > 1
    lie = forged(honest, lambda f: f.update(chunks=[fake_digest(i) for i in range(len(f["chunks"]))]))
    opened = publisher.open(lie, ("poisoned",))
    assert opened.status_code == 201, opened.text
    session = UploadSession.model_validate_json(opened.content)
    assert all(blob.present for blob in session.blobs), "every blob is stored already: nothing to upload"
    commit = publisher.commit(session)
    assert commit.status_code == 422, commit.text
    message = problem(commit)["detail"]
    assert all(part in message for part in (WEIGHTS, weights.sha256, "chunk 0"))
    assert version_status(cp_client, publisher.headers, session.digest) == 404
    assert cp_client.get("/v1/models/llama/versions/poisoned", headers=publisher.headers).status_code == 404
    assert bigger not in chunk_lists(cp_state, weights.sha256)
    state = cp_client.get(f"/v1/uploads/{session.id}", headers=publisher.headers).json()["state"]
    assert state == "open", "a refused commit leaves the session open to fix, never half-committed"

    fixed = publisher.session(honest, ("v1-rechunked",))
    response = publisher.commit(fixed)
    assert response.status_code == 200, response.text
    assert response.json()["digest"] != v1.digest
    assert chunk_lists(cp_state, weights.sha256)[bigger] == list(honest.file(WEIGHTS).chunks)


def test_a_manifest_re_describing_a_known_blob_is_refused_with_422(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client
) -> None:
    """Same blob, same chunk size, one chunk digest changed: 422 at open, naming file, blob and chunk."""
    root = make_model("m", tensors_mb=0.3, seed=8)
    publisher.publish(root, "llama", ("v1",))
    manifest = publisher.manifest(root, "llama")
    weights = manifest.file(WEIGHTS)

    def change_chunk_2(entry: dict[str, Any]) -> None:
        entry["chunks"][2] = fake_digest(2)

    response = publisher.open(forged(manifest, change_chunk_2), ("v2",))
    assert response.status_code == 422, response.text
    error = problem(response)
    assert error["code"] == "integrity"
    assert all(part in error["detail"] for part in (WEIGHTS, weights.sha256, "chunk 2", weights.chunks[2]))
    assert cp_client.get("/v1/models/llama/versions/v2", headers=publisher.headers).status_code == 404


def test_a_re_description_opened_before_the_blob_was_verified_is_refused_at_commit(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client, cp_state: AppState
) -> None:
    """The liar opens first, the honest publisher commits first: the liar's commit meets the verified list (422)."""
    root = make_model("m", tensors_mb=0.3, seed=9)
    manifest = publisher.manifest(root, "llama")
    lie = forged(manifest, lambda f: f["chunks"].__setitem__(1, fake_digest(1)))
    opened = publisher.open(lie)
    assert opened.status_code == 201, opened.text
    liar = UploadSession.model_validate_json(opened.content)
    publisher.publish(root, "llama", ("v1",))
    commit = publisher.commit(liar)
    assert commit.status_code == 422, commit.text
    assert "chunk 1" in problem(commit)["detail"]
    assert version_status(cp_client, publisher.headers, liar.digest) == 404
    with cp_state.sessions() as session:
        row = session.get(UploadSessionRow, liar.id)
        assert row is not None
        assert row.state == "open"


def test_a_multi_chunk_blob_whose_bytes_do_not_match_its_name_is_never_ready_and_squats_nothing(
    publisher: Publisher, make_model: ModelMaker, cp_client: httpx.Client, cp_state: AppState
) -> None:
    """Real chunk digests of other bytes under a victim's blob name: every part passes, the whole file does not.

    On S3 the parts are checked by S3 itself, so only the control plane's whole-file hash of the
    staged upload catches it. The victim's name stays free (nothing under blobs/ or uploads/),
    and the honest publish of that name afterwards succeeds with the honest bytes.
    """
    victim_root = make_model("victim", tensors_mb=0.3, seed=1)
    victim = publisher.manifest(victim_root, "llama").file(WEIGHTS)
    attacker_root = make_model("attacker", tensors_mb=0.3, seed=2)
    attacker = publisher.manifest(attacker_root, "llama")
    assert len(attacker.file(WEIGHTS).chunks) > 1
    lie = forged(attacker, lambda f: f.update(sha256=victim.sha256))
    opened = publisher.open(lie)
    assert opened.status_code == 201, opened.text
    session = UploadSession.model_validate_json(opened.content)
    blob = next(b for b in session.blobs if b.sha256 == victim.sha256)
    data = (attacker_root / WEIGHTS).read_bytes()
    for part in blob.parts:
        put = publisher.put(part, data[part.offset : part.offset + part.length])
        assert put.status_code in (200, 204), "each part is honest about its own bytes"
    publisher.upload(session, attacker_root, attacker, only=lambda sha, _part: sha != victim.sha256)
    commit = publisher.commit(session)
    assert commit.status_code == 422, commit.text
    assert "whole file hashes to" in problem(commit)["detail"]
    assert version_status(cp_client, publisher.headers, session.digest) == 404
    store = cp_state.store
    assert store.stat_blob(victim.sha256) is None, "the victim's blob name is not occupied"
    assert chunk_lists(cp_state, victim.sha256) == {}
    if isinstance(store, S3Store):
        staged = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + UPLOADS)
        assert staged.get("KeyCount", 0) == 0, "the refused upload was deleted, not left staged"

    _, honest = publisher.publish(victim_root, "llama", ("v1",))
    assert honest.state == "ready"
    assert b"".join(store.read_blob(victim.sha256)) == (victim_root / WEIGHTS).read_bytes()


def test_an_empty_file_cannot_claim_another_blob_name(
    publisher: Publisher, make_model: ModelMaker, cp_state: AppState, tmp_path: Path
) -> None:
    """A size-0 file whose sha256 is someone else's blob name: 422 at open, no empty object written there."""
    root = make_model("m", tensors_mb=0.1, seed=3)
    manifest = publisher.manifest(root, "llama")
    victim = hashlib.sha256(os.urandom(64)).hexdigest()
    doc = json.loads(manifest.raw)
    doc["files"].append({"path": "empty.txt", "size": 0, "sha256": victim, "media_type": "text/plain", "chunks": []})
    doc["files"].sort(key=lambda f: f["path"])
    response = publisher.open(canonical_json(doc))
    assert response.status_code == 422, response.text
    assert "empty file" in problem(response)["detail"]
    assert cp_state.store.stat_blob(victim) is None
