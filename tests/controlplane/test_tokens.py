"""Tokens: the bootstrap admin, minting per role, listing without secrets, revoking."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from sqlalchemy import func, select

from controlplane.auth import hash_secret
from controlplane.persistence.rows import TokenRow
from controlplane.state import AppState
from controlplane.tokens import BOOTSTRAP_NAME, bootstrap_admin
from tests.controlplane.conftest import problem
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(60)


def _count(state: AppState, secret: str) -> int:
    with state.sessions() as session:
        return int(session.scalar(select(func.count()).where(TokenRow.secret_hash == hash_secret(secret))) or 0)


def test_bootstrap_admin_token_works_and_is_stored_hashed(
    cp_client: httpx.Client, cp_state: AppState, admin_headers: dict[str, str], admin_token: str
) -> None:
    response = cp_client.get("/v1/tokens", headers=admin_headers)
    assert response.status_code == 200
    assert [(t["name"], t["role"]) for t in response.json()] == [(BOOTSTRAP_NAME, "admin")]
    with cp_state.sessions() as session:
        stored = session.scalars(select(TokenRow.secret_hash)).all()
    assert stored == [hash_secret(admin_token)]
    assert admin_token not in stored


def test_bootstrap_admin_is_idempotent(cp_state: AppState, admin_token: str) -> None:
    bootstrap_admin(cp_state)
    bootstrap_admin(cp_state)
    assert _count(cp_state, admin_token) == 1


def test_revoked_bootstrap_token_stays_revoked_after_restart(
    cp_client: httpx.Client, cp_state: AppState, admin_headers: dict[str, str], admin_token: str
) -> None:
    (token,) = cp_client.get("/v1/tokens", headers=admin_headers).json()
    assert cp_client.delete(f"/v1/tokens/{token['id']}", headers=admin_headers).status_code == 204
    bootstrap_admin(cp_state)  # what a restart with the same environment does
    assert _count(cp_state, admin_token) == 1
    assert cp_client.get("/v1/tokens", headers=admin_headers).status_code == 401


def test_empty_admin_token_creates_no_token(cp_state: AppState, admin_token: str) -> None:
    state = dataclasses.replace(cp_state, settings=dataclasses.replace(cp_state.settings, admin_token=""))
    bootstrap_admin(state)
    with cp_state.sessions() as session:
        assert session.scalar(select(func.count()).select_from(TokenRow)) == 1  # only the fixture's


def test_minted_token_authenticates_with_its_role(
    cp_client: httpx.Client, admin_headers: dict[str, str], subtests: pytest.Subtests
) -> None:
    for role in Role:
        with subtests.test(role=role.value):
            created = cp_client.post(
                "/v1/tokens", json={"name": f"ci {role.value}", "role": role.value}, headers=admin_headers
            )
            assert created.status_code == 201, created.text
            body = created.json()
            assert body["role"] == role.value
            assert body["token"].startswith("ws_")
            headers = {"Authorization": f"Bearer {body['token']}"}
            # Any role may read deployments, but an agent token minted here is an enrolment token, which can
            # only enrol; only admin may list tokens.
            can_read = 403 if role is Role.agent else 200
            assert cp_client.get("/v1/deployments", headers=headers).status_code == can_read
            assert cp_client.get("/v1/tokens", headers=headers).status_code == (200 if role is Role.admin else 403)


def test_token_list_shows_no_secrets_and_who_created_them(
    cp_client: httpx.Client, admin_headers: dict[str, str]
) -> None:
    created = cp_client.post("/v1/tokens", json={"name": "ci", "role": "publisher"}, headers=admin_headers).json()
    listed = cp_client.get("/v1/tokens", headers=admin_headers).json()
    mine = next(t for t in listed if t["id"] == created["id"])
    assert mine == {
        "id": created["id"],
        "name": "ci",
        "role": "publisher",
        "created_at": mine["created_at"],
        "created_by": BOOTSTRAP_NAME,
        "node_id": None,
        "deployments": None,
        "node_role": None,
    }
    assert created["token"] not in str(listed)


def test_revoked_token_is_refused_and_unlisted(cp_client: httpx.Client, admin_headers: dict[str, str]) -> None:
    created = cp_client.post("/v1/tokens", json={"name": "ci", "role": "operator"}, headers=admin_headers).json()
    headers = {"Authorization": f"Bearer {created['token']}"}
    assert cp_client.get("/v1/deployments", headers=headers).status_code == 200
    assert cp_client.delete(f"/v1/tokens/{created['id']}", headers=admin_headers).status_code == 204
    refused = cp_client.get("/v1/deployments", headers=headers)
    assert refused.status_code == 401
    assert "revoked" in problem(refused)["detail"]
    assert created["id"] not in [t["id"] for t in cp_client.get("/v1/tokens", headers=admin_headers).json()]


def test_revoking_an_unknown_token_is_404(cp_client: httpx.Client, admin_headers: dict[str, str]) -> None:
    for token_id in ["does-not-exist", "0" * 16]:
        response = cp_client.delete(f"/v1/tokens/{token_id}", headers=admin_headers)
        assert response.status_code == 404
        assert problem(response)["code"] == "not_found"


def test_invalid_token_requests_are_422(
    cp_client: httpx.Client, admin_headers: dict[str, str], subtests: pytest.Subtests
) -> None:
    bodies: list[dict[str, object]] = [
        {"name": "", "role": "admin"},
        {"name": "x", "role": "root"},
        {"name": "x"},
        {"name": "x", "role": "admin", "extra": 1},
    ]
    for body in bodies:
        with subtests.test(body=body):
            response = cp_client.post("/v1/tokens", json=body, headers=admin_headers)
            assert response.status_code == 422
            assert problem(response)["code"] == "invalid_request"
