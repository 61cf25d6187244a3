"""Deployments and serving pointers: ETag/If-Match compare-and-swap, refs, rollback, audit history."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from controlplane.deployments import Pointer, change_pointer
from controlplane.persistence.rows import PointerEventRow
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from weightship.errors import PreconditionFailed
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(60)

Headers = dict[str, str]


@pytest.fixture
def operator(role_headers: dict[Role, Headers]) -> Headers:
    """Headers of an operator token."""
    return role_headers[Role.operator]


@pytest.fixture
def versions(seed_versions: Any) -> dict[str, str]:
    """Ready versions v1..v3 of model ``llama``, another model's v1 (as ``other``), and a non-ready one."""
    digests: dict[str, str] = seed_versions("llama")
    digests["other"] = seed_versions("mistral", labels=("v1",))["v1"]
    digests["broken"] = seed_versions("llama", labels=("broken",), state="failed")["broken"]
    return digests


@pytest.fixture
def deployment(cp_client: httpx.Client, operator: Headers, versions: dict[str, str]) -> str:
    """A deployment ``chat`` of model ``llama`` with an empty pointer."""
    response = cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=operator)
    assert response.status_code == 201, response.text
    return "chat"


def put_pointer(client: httpx.Client, headers: Headers, name: str, epoch: int | None, **body: Any) -> httpx.Response:
    """PUT the pointer, with ``If-Match: "<epoch>"`` unless ``epoch`` is None."""
    extra = {"If-Match": f'"{epoch}"'} if epoch is not None else {}
    return client.put(f"/v1/deployments/{name}/pointer", json=body, headers={**headers, **extra})


def current_epoch(client: httpx.Client, headers: Headers, name: str) -> int:
    """The epoch as the ETag reports it."""
    response = client.get(f"/v1/deployments/{name}", headers=headers)
    assert response.status_code == 200
    return int(response.headers["etag"].strip('"'))


# --- create, read ------------------------------------------------------------------------------


def test_created_deployment_has_an_empty_pointer_at_epoch_0(
    cp_client: httpx.Client, operator: Headers, deployment: str
) -> None:
    response = cp_client.get(f"/v1/deployments/{deployment}", headers=operator)
    assert response.status_code == 200
    assert response.headers["etag"] == '"0"'
    body = response.json()
    assert (body["model"], body["stable"], body["previous_stable"], body["canary"], body["epoch"]) == (
        "llama",
        None,
        None,
        None,
        0,
    )
    assert [d["name"] for d in cp_client.get("/v1/deployments", headers=operator).json()] == ["chat"]


def test_create_refuses_duplicates_unknown_models_and_bad_names(
    cp_client: httpx.Client, operator: Headers, deployment: str, subtests: pytest.Subtests
) -> None:
    cases = [
        ({"name": "chat", "model": "llama"}, 409, "deployment_exists"),  # exists already
        ({"name": "new", "model": "nope"}, 404, "model_not_found"),  # no such model
        ({"name": "Bad Name", "model": "llama"}, 422, "invalid_request"),
    ]
    for body, status, code in cases:
        with subtests.test(body=body):
            response = cp_client.post("/v1/deployments", json=body, headers=operator)
            assert response.status_code == status, response.text
            assert problem(response)["code"] == code


def test_unknown_deployment_is_404_everywhere(cp_client: httpx.Client, operator: Headers) -> None:
    for method, path in [
        ("GET", "/v1/deployments/ghost"),
        ("GET", "/v1/deployments/ghost/history"),
        ("POST", "/v1/deployments/ghost/rollback"),
    ]:
        response = cp_client.request(method, path, headers=operator)
        assert response.status_code == 404, (method, path)
        assert "ghost" in problem(response)["detail"]
    assert put_pointer(cp_client, operator, "ghost", 0, stable="v1").status_code == 404


# --- compare-and-swap ---------------------------------------------------------------------------


def test_pointer_update_without_if_match_is_428(cp_client: httpx.Client, operator: Headers, deployment: str) -> None:
    response = put_pointer(cp_client, operator, deployment, None, stable="v1")
    assert response.status_code == 428
    assert problem(response)["code"] == "precondition_required"
    assert "If-Match" in problem(response)["detail"]
    assert current_epoch(cp_client, operator, deployment) == 0


def test_pointer_update_with_stale_if_match_is_412_and_changes_nothing(
    cp_client: httpx.Client, operator: Headers, deployment: str, subtests: pytest.Subtests
) -> None:
    for if_match in ['"1"', '"7"', "1"]:
        with subtests.test(if_match=if_match):
            response = cp_client.put(
                f"/v1/deployments/{deployment}/pointer",
                json={"stable": "v1"},
                headers={**operator, "If-Match": if_match},
            )
            assert response.status_code == 412
            assert problem(response)["code"] == "pointer_stale"
            assert "epoch 0" in problem(response)["detail"]
    assert cp_client.get(f"/v1/deployments/{deployment}", headers=operator).json()["stable"] is None


def test_if_match_accepts_the_etag_in_its_usual_spellings(
    cp_client: httpx.Client, operator: Headers, deployment: str, subtests: pytest.Subtests
) -> None:
    for epoch, spelling in enumerate(['W/"{}"', "{}", '"{}"']):
        with subtests.test(spelling=spelling):
            response = cp_client.put(
                f"/v1/deployments/{deployment}/pointer",
                json={"stable": f"v{epoch + 1}"},
                headers={**operator, "If-Match": spelling.format(epoch)},
            )
            assert response.status_code == 200, response.text
            assert response.headers["etag"] == f'"{epoch + 1}"'


def test_malformed_if_match_is_400(
    cp_client: httpx.Client, operator: Headers, deployment: str, subtests: pytest.Subtests
) -> None:
    for if_match in ["*", '"a"', '"1", "2"', "-1", '"0']:
        with subtests.test(if_match=if_match):
            response = cp_client.put(
                f"/v1/deployments/{deployment}/pointer",
                json={"stable": "v1"},
                headers={**operator, "If-Match": if_match},
            )
            assert response.status_code == 400
            assert problem(response)["code"] == "if_match_invalid"


# --- refs ---------------------------------------------------------------------------------------


def test_refs_may_be_labels_or_digests(
    cp_client: httpx.Client, operator: Headers, deployment: str, versions: dict[str, str]
) -> None:
    by_label = put_pointer(cp_client, operator, deployment, 0, stable="v1")
    assert by_label.json()["stable"] == versions["v1"]
    by_digest = put_pointer(cp_client, operator, deployment, 1, stable=versions["v2"])
    assert by_digest.json()["stable"] == versions["v2"]


def test_bad_refs_get_clear_errors_and_change_nothing(
    cp_client: httpx.Client,
    operator: Headers,
    deployment: str,
    versions: dict[str, str],
    subtests: pytest.Subtests,
) -> None:
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({"stable": "v9"}, 404, "version_not_found", "no label 'v9'"),
        ({"stable": "sha256:" + "0" * 64}, 404, "version_not_found", "has no version"),
        ({"stable": versions["other"]}, 409, "version_of_other_model", "belongs to model 'mistral'"),
        ({"stable": "broken"}, 409, "version_not_ready", "not ready"),
        ({"stable": "sha256:XYZ"}, 400, "invalid", "not a version digest"),
        ({"stable": "v1", "canary": "v9", "canary_share": 0.1}, 404, "version_not_found", "no label 'v9'"),
        ({"stable": "v1", "canary_share": 0.5}, 400, "share_without_canary", "no canary is named"),
        ({"stable": "v1", "canary": "v1", "canary_share": 0.5}, 400, "canary_is_stable", "same version"),
        ({"stable": "v1", "canary": "v2", "canary_share": 1.5}, 422, "invalid_request", "canary_share"),
    ]
    for body, status, code, says in cases:
        with subtests.test(body=body):
            response = put_pointer(cp_client, operator, deployment, 0, **body)
            assert response.status_code == status, response.text
            assert problem(response)["code"] == code
            assert says in problem(response)["detail"]
    assert current_epoch(cp_client, operator, deployment) == 0


# --- epochs, previous stable, audit -------------------------------------------------------------


def test_epochs_strictly_increase_and_every_change_writes_one_history_row(
    cp_client: httpx.Client, operator: Headers, deployment: str, versions: dict[str, str]
) -> None:
    v1, v2, v3 = versions["v1"], versions["v2"], versions["v3"]
    steps: list[tuple[dict[str, Any], str, tuple[str | None, str | None, str | None, float]]] = [
        # body, expected action, expected (stable, previous_stable, canary, share) afterwards
        ({"stable": "v1", "reason": "first"}, "set", (v1, None, None, 0.0)),
        ({"stable": "v1", "canary": "v2", "canary_share": 0.1}, "canary", (v1, None, v2, 0.1)),
        ({"stable": "v1", "canary": "v2", "canary_share": 0.5}, "canary", (v1, None, v2, 0.5)),
        ({"stable": "v2"}, "promote", (v2, v1, None, 0.0)),
        ({"stable": "v2", "canary": "v3", "canary_share": 0.2}, "canary", (v2, v1, v3, 0.2)),
        ({"stable": "v2", "reason": "bad canary"}, "abort", (v2, v1, None, 0.0)),
        ({"stable": "v3"}, "set", (v3, v2, None, 0.0)),
    ]
    epochs = []
    for epoch, (body, _action, want) in enumerate(steps):
        response = put_pointer(cp_client, operator, deployment, epoch, **body)
        assert response.status_code == 200, response.text
        got = response.json()
        assert (got["stable"], got["previous_stable"], got["canary"], got["canary_share"]) == want
        assert response.headers["etag"] == f'"{got["epoch"]}"'
        epochs.append(got["epoch"])
    assert epochs == list(range(1, len(steps) + 1))

    history = cp_client.get(f"/v1/deployments/{deployment}/history", headers=operator).json()
    assert [h["epoch"] for h in history] == epochs[::-1]  # newest first
    oldest_first = history[::-1]
    assert [h["action"] for h in oldest_first] == [action for _, action, _ in steps]
    assert {h["actor"] for h in history} == {"test-operator"}
    assert oldest_first[0]["reason"] == "first"
    for before, after in itertools.pairwise(oldest_first):
        assert after["from_stable"] == before["to_stable"]
        assert after["from_canary"] == before["to_canary"]


def test_history_pages_with_limit_and_before_epoch(cp_client: httpx.Client, operator: Headers, deployment: str) -> None:
    for epoch, ref in enumerate(["v1", "v2", "v3", "v1", "v2"]):
        assert put_pointer(cp_client, operator, deployment, epoch, stable=ref).status_code == 200
    page = cp_client.get(f"/v1/deployments/{deployment}/history", params={"limit": 2}, headers=operator).json()
    assert [h["epoch"] for h in page] == [5, 4]
    rest = cp_client.get(f"/v1/deployments/{deployment}/history", params={"before_epoch": 4}, headers=operator).json()
    assert [h["epoch"] for h in rest] == [3, 2, 1]


def test_audit_rows_are_written_with_the_pointer_in_one_transaction(
    cp_client: httpx.Client, operator: Headers, deployment: str, cp_state: AppState
) -> None:
    assert put_pointer(cp_client, operator, deployment, 0, stable="v1").status_code == 200
    assert put_pointer(cp_client, operator, deployment, 0, stable="v2").status_code == 412  # lost: no row
    with cp_state.sessions() as session:
        rows = session.scalars(select(PointerEventRow).where(PointerEventRow.deployment == deployment)).all()
    assert [(r.epoch, r.action) for r in rows] == [(1, "set")]


def test_every_change_notifies_long_polls(
    cp_client: httpx.Client, operator: Headers, deployment: str, cp_state: AppState
) -> None:
    before = cp_state.pointer_generation
    assert put_pointer(cp_client, operator, deployment, 0, stable="v1").status_code == 200
    assert put_pointer(cp_client, operator, deployment, 1, stable="v2").status_code == 200
    assert cp_client.post(f"/v1/deployments/{deployment}/rollback", headers=operator).status_code == 200
    assert cp_state.pointer_generation == before + 3


# --- rollback -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stables", [[], ["v1"]], ids=["never-set", "one-stable"])
def test_rollback_without_previous_stable_is_409(
    cp_client: httpx.Client, operator: Headers, deployment: str, stables: list[str]
) -> None:
    for epoch, ref in enumerate(stables):
        assert put_pointer(cp_client, operator, deployment, epoch, stable=ref).status_code == 200
    response = cp_client.post(f"/v1/deployments/{deployment}/rollback", json={}, headers=operator)
    assert response.status_code == 409
    assert problem(response)["code"] == "no_previous_stable"
    assert "no previous stable version" in problem(response)["detail"]
    assert current_epoch(cp_client, operator, deployment) == len(stables)


def test_rollback_is_a_new_higher_epoch_naming_the_older_digest(
    cp_client: httpx.Client, operator: Headers, deployment: str, versions: dict[str, str]
) -> None:
    put_pointer(cp_client, operator, deployment, 0, stable="v1")
    put_pointer(cp_client, operator, deployment, 1, stable="v2", canary="v3", canary_share=0.3)
    response = cp_client.post(
        f"/v1/deployments/{deployment}/rollback", json={"reason": "p99 regression"}, headers=operator
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["epoch"] == 3
    assert response.headers["etag"] == '"3"'
    assert (body["stable"], body["previous_stable"], body["canary"], body["canary_share"]) == (
        versions["v1"],
        versions["v2"],
        None,
        0.0,
    )
    (event, *_) = cp_client.get(f"/v1/deployments/{deployment}/history", headers=operator).json()
    assert (event["epoch"], event["action"], event["reason"]) == (3, "rollback", "p99 regression")
    assert (event["from_stable"], event["to_stable"], event["from_canary"]) == (
        versions["v2"],
        versions["v1"],
        versions["v3"],
    )


def test_rolling_back_twice_returns_to_where_it_started(
    cp_client: httpx.Client, operator: Headers, deployment: str, versions: dict[str, str]
) -> None:
    put_pointer(cp_client, operator, deployment, 0, stable="v1")
    put_pointer(cp_client, operator, deployment, 1, stable="v2")
    first = cp_client.post(f"/v1/deployments/{deployment}/rollback", headers=operator).json()
    second = cp_client.post(f"/v1/deployments/{deployment}/rollback", headers=operator).json()
    assert (first["stable"], first["epoch"]) == (versions["v1"], 3)
    assert (second["stable"], second["previous_stable"], second["epoch"]) == (versions["v2"], versions["v1"], 4)


def test_rollback_to_a_named_ready_version(
    cp_client: httpx.Client, operator: Headers, deployment: str, versions: dict[str, str], subtests: pytest.Subtests
) -> None:
    for epoch, ref in enumerate(["v1", "v2", "v3"]):
        put_pointer(cp_client, operator, deployment, epoch, stable=ref)
    # by label from v3 to v1, then by digest from v1 to v2
    for to, want, previous in [("v1", "v1", "v3"), (versions["v2"], "v2", "v1")]:
        with subtests.test(to=to):
            response = cp_client.post(f"/v1/deployments/{deployment}/rollback", json={"to": to}, headers=operator)
            assert response.status_code == 200, response.text
            assert (response.json()["stable"], response.json()["previous_stable"]) == (
                versions[want],
                versions[previous],
            )


def test_rollback_to_a_bad_target_is_refused(
    cp_client: httpx.Client, operator: Headers, deployment: str, subtests: pytest.Subtests
) -> None:
    put_pointer(cp_client, operator, deployment, 0, stable="v1")
    put_pointer(cp_client, operator, deployment, 1, stable="v2")
    for to, status, says in [("v9", 404, "no label"), ("broken", 409, "not ready"), ("v2", 409, "already serves")]:
        with subtests.test(to=to):
            response = cp_client.post(f"/v1/deployments/{deployment}/rollback", json={"to": to}, headers=operator)
            assert response.status_code == status, response.text
            assert says in problem(response)["detail"]
    assert current_epoch(cp_client, operator, deployment) == 2


def test_rollback_honours_if_match_when_given(cp_client: httpx.Client, operator: Headers, deployment: str) -> None:
    put_pointer(cp_client, operator, deployment, 0, stable="v1")
    put_pointer(cp_client, operator, deployment, 1, stable="v2")
    stale = cp_client.post(f"/v1/deployments/{deployment}/rollback", headers={**operator, "If-Match": '"1"'})
    assert stale.status_code == 412
    fresh = cp_client.post(f"/v1/deployments/{deployment}/rollback", headers={**operator, "If-Match": '"2"'})
    assert fresh.status_code == 200
    assert fresh.json()["epoch"] == 3


def test_the_sql_compare_and_swap_refuses_a_stale_epoch_on_its_own(
    cp_client: httpx.Client, operator: Headers, deployment: str, cp_state: AppState, versions: dict[str, str]
) -> None:
    # Skip the route's early epoch check: the UPDATE ... WHERE epoch = :expected alone must refuse.
    assert put_pointer(cp_client, operator, deployment, 0, stable="v1").status_code == 200
    stale = Pointer(stable=None, previous_stable=None, canary=None, canary_share=0.0)
    wanted = Pointer(stable=versions["v2"], previous_stable=None, canary=None, canary_share=0.0)
    with pytest.raises(PreconditionFailed, match="epoch 1"):
        change_pointer(cp_state, deployment, 0, stale, wanted, model="llama", action="set", actor="t", reason="")
    body = cp_client.get(f"/v1/deployments/{deployment}", headers=operator).json()
    assert (body["epoch"], body["stable"]) == (1, versions["v1"])
