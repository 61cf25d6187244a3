"""The control plane's signing checks: publish, added signatures (write-once, append-only), pointer moves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from model_signing import verifying as ms_verifying
from typer.testing import CliRunner

from controlplane.settings import Settings
from tests.controlplane.conftest import LiveControlPlane, Publisher
from tests.signing_material import Signer, policy_json
from weightship.cli import app
from weightship.manifest import SIGNATURE_FILE, build_manifest
from weightship.schemas import Role
from weightship.signing import sign_manifest

pytestmark = pytest.mark.timeout(60)

MODEL = "signed-llama"
Headers = dict[str, str]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Signer]:
    return {name: Signer.new(tmp_path / "keys" / name) for name in ("release", "approver", "stranger")}


@pytest.fixture
def policy_file(tmp_path: Path, keys: dict[str, Signer]) -> Path:
    path = tmp_path / "policy.json"
    trusted = [{"id": n, "public_key": keys[n].public_pem} for n in ("release", "approver")]
    path.write_bytes(policy_json(MODEL, keys=trusted, require=False))
    return path


@pytest.fixture
def cp_settings(cp_settings: Settings, policy_file: Path) -> Settings:
    return dataclasses.replace(cp_settings, signing_policy_file=str(policy_file))


def _model(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"text": text}))
    return root


def _commit(publisher: Publisher, root: Path, signers: list[Signer]) -> httpx.Response:
    manifest = publisher.manifest(root, MODEL)
    session = publisher.session(manifest)
    publisher.upload(session, root, manifest)
    body = {"signatures": [sign_manifest(manifest, s.private_pem).decode() for s in signers]}
    return publisher.client.post(f"/v1/uploads/{session.id}/commit", json=body, headers=publisher.headers)


def _require(policy_file: Path, keys: dict[str, Signer]) -> None:
    trusted = [{"id": "release", "public_key": keys["release"].public_pem}]
    policy_file.write_bytes(policy_json(MODEL, keys=trusted, require=True))


def test_a_signed_publish_stores_its_signature_and_a_second_approver_appends(
    publisher: Publisher, keys: dict[str, Signer], tmp_path: Path
) -> None:
    response = _commit(publisher, _model(tmp_path / "m", "v1"), [keys["release"]])
    assert response.status_code == 200, response.text
    digest = response.json()["digest"]
    url = f"/v1/models/{MODEL}/versions/{digest}/signatures"
    manifest = publisher.manifest(tmp_path / "m", MODEL)

    second = sign_manifest(manifest, keys["approver"].private_pem).decode()
    added = publisher.client.post(url, json={"signatures": [second]}, headers=publisher.headers)
    again = publisher.client.post(url, json={"signatures": [second]}, headers=publisher.headers)
    listed = publisher.client.get(url, headers=publisher.headers)

    assert added.status_code == 201, added.text
    assert again.status_code == 201, again.text
    assert len(listed.json()["signatures"]) == 2


def test_a_signature_by_an_untrusted_key_is_refused_naming_model_key_and_reason(
    publisher: Publisher, keys: dict[str, Signer], tmp_path: Path
) -> None:
    response = _commit(publisher, _model(tmp_path / "m", "v1"), [keys["stranger"]])

    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["code"] == "signature_refused"
    assert MODEL in problem["detail"]
    assert "unknown key" in problem["detail"]


def test_unsigned_publish_pointer_move_rollback_rollout_and_preheat_are_refused_once_the_policy_requires_signatures(
    publisher: Publisher,
    keys: dict[str, Signer],
    policy_file: Path,
    cp_client: httpx.Client,
    role_headers: dict[Role, Headers],
    tmp_path: Path,
) -> None:
    operator = role_headers[Role.operator]
    unsigned = _commit(publisher, _model(tmp_path / "a", "unsigned"), []).json()["digest"]
    signed = _commit(publisher, _model(tmp_path / "b", "signed"), [keys["release"]]).json()["digest"]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": MODEL}, headers=operator).is_success
    pointer = "/v1/deployments/chat/pointer"
    assert cp_client.put(pointer, json={"stable": unsigned}, headers={**operator, "If-Match": '"0"'}).is_success
    _require(policy_file, keys)

    refused_publish = _commit(publisher, _model(tmp_path / "c", "late"), [])
    moved = cp_client.put(pointer, json={"stable": signed}, headers={**operator, "If-Match": '"1"'})
    rolled = cp_client.post("/v1/deployments/chat/rollback", json={"reason": "test"}, headers=operator)

    assert refused_publish.status_code == 422
    assert "unsigned" in refused_publish.json()["detail"]
    assert moved.status_code == 200, moved.text
    assert rolled.status_code == 422, rolled.text
    assert rolled.json()["code"] == "signature_refused"
    assert unsigned in rolled.json()["detail"]
    rollout = cp_client.post(
        "/v1/deployments/chat/rollouts", json={"spec": {"version": unsigned, "steps": []}}, headers=operator
    )
    preheat = cp_client.post("/v1/deployments/chat/preheats", json={"version": unsigned}, headers=operator)
    for refused in (rollout, preheat):
        assert refused.status_code == 422, refused.text
        assert refused.json()["code"] == "signature_refused"


def test_weightship_publish_signs_in_the_format_model_signing_verifies_for_the_directory_as_it_is(
    live_controlplane: LiveControlPlane, role_headers: dict[Role, Headers], keys: dict[str, Signer], tmp_path: Path
) -> None:
    root = _model(tmp_path / MODEL, "v1")
    (root / ".gitattributes").write_text("* binary\n")
    token = role_headers[Role.publisher]["Authorization"].removeprefix("Bearer ")
    env = {"WEIGHTSHIP_URL": live_controlplane.url, "WEIGHTSHIP_TOKEN": token}
    args = ["--json", "publish", str(root), "-m", MODEL, "--chunk-size", "64KiB", "--sign-key", str(keys["release"].key_file)]

    result = CliRunner().invoke(app, args, env=env, catch_exceptions=False)

    assert result.exit_code == 0, result.output
    published = json.loads(result.output)
    assert published["signatures"] == 1
    with httpx.Client(base_url=live_controlplane.url, headers=role_headers[Role.publisher]) as client:
        stored = client.get(f"/v1/models/{MODEL}/versions/{published['digest']}/signatures").json()["signatures"]
    (root / SIGNATURE_FILE).write_text(stored[0])
    verifier = ms_verifying.Config()  # type: ignore[no-untyped-call]  # the library's constructors are unannotated
    verifier.use_elliptic_key_verifier(public_key=keys["release"].public_file).verify(root, root / SIGNATURE_FILE)


def test_weightship_publish_picks_up_the_directory_s_model_sig(
    live_controlplane: LiveControlPlane, role_headers: dict[Role, Headers], keys: dict[str, Signer], tmp_path: Path
) -> None:
    root = _model(tmp_path / MODEL, "v2")
    (root / SIGNATURE_FILE).write_bytes(sign_manifest(build_manifest(root, MODEL), keys["release"].private_pem))
    token = role_headers[Role.publisher]["Authorization"].removeprefix("Bearer ")
    env = {"WEIGHTSHIP_URL": live_controlplane.url, "WEIGHTSHIP_TOKEN": token}

    result = CliRunner().invoke(app, ["--json", "publish", str(root), "-m", MODEL], env=env, catch_exceptions=False)

    assert result.exit_code == 0, result.output
    published = json.loads(result.output)
    assert published["signatures"] == 1
    assert SIGNATURE_FILE in published["skipped"]
