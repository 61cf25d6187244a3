"""One error boundary: every error is RFC 9457 problem details, and the OpenAPI document says which.

The tests walk the served OpenAPI document: each ``/v1`` operation must document its error
statuses with the ``Problem`` schema, and a table of bad requests (no token, each role, unknown
names, bad bodies and queries, oversized bodies) is sent to every operation over real HTTP. Every
answer must be a status that operation documents, and every error answer problem details. Each
route is also driven into the documented statuses that a generic bad request can reach (401,
403, 404, 413, 422); framework errors (404, 405, 500) answer problem details too.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from controlplane.app import create_app
from controlplane.http.limits import BodyLimit
from controlplane.settings import Settings
from tests.controlplane.auth_parts import ENROL, NODE, ROLE_CONTRACT
from tests.controlplane.conftest import problem

pytestmark = pytest.mark.timeout(180)

_PARAM = re.compile(r"\{([^}]+)\}")
#: bodies up to this size are sent to drive a route into 413 (larger limits: a whole chunk, a manifest)
_OVERSIZE_UP_TO = 2 * 1024 * 1024
Operation = tuple[str, str]  # (METHOD, path template)
#: where 422 is a domain answer (bytes that do not match their digests), not a malformed request:
#: driven by tests/controlplane/test_publish.py and tests/security/test_commit_integrity.py
_INTEGRITY_422: frozenset[Operation] = frozenset({("POST", "/v1/uploads"), ("POST", "/v1/uploads/{upload_id}/commit")})



def _operations(doc: dict[str, Any]) -> dict[Operation, dict[str, Any]]:
    return {
        (method.upper(), path): operation
        for path, operations in doc["paths"].items()
        if path.startswith("/v1/")
        for method, operation in operations.items()
    }


def _fill(path: str, node_id: str | None = None, value: str = "0" * 64) -> str:
    def one(match: re.Match[str]) -> str:
        return node_id if match.group(1) == "node_id" and node_id else value

    return _PARAM.sub(one, path)


def _contract(method: str, path: str) -> frozenset[str] | None:
    return ROLE_CONTRACT.get((method, _PARAM.sub("{}", path)))


def test_every_error_status_in_the_openapi_is_a_problem(cp_client: httpx.Client) -> None:
    doc = cp_client.get("/openapi.json").json()
    assert "Problem" in doc["components"]["schemas"]
    assert {"type", "title", "status", "detail", "instance", "code"} <= set(
        doc["components"]["schemas"]["Problem"]["properties"]
    )
    operations = _operations(doc)
    assert len(operations) >= 25
    failures: list[str] = []
    for (method, path), operation in operations.items():
        statuses = {int(s) for s in operation["responses"]}
        needed = {413, 500, 503} | ({401, 403} if _contract(method, path) is not None else set())
        if missing := needed - statuses:
            failures.append(f"{method} {path} does not document {sorted(missing)}")
        for status, response in operation["responses"].items():
            if int(status) < 400:
                continue
            content = response.get("content", {})
            if list(content) != ["application/problem+json"] or content["application/problem+json"]["schema"] != {
                "$ref": "#/components/schemas/Problem"
            }:
                failures.append(f"{method} {path} {status} is not documented as a problem: {content}")
    assert not failures, "\n".join(failures)


def _bad_requests(
    method: str, path: str, callers: dict[str, tuple[dict[str, str], str]]
) -> list[tuple[str, str, dict[str, Any]]]:
    """(what, url, httpx request arguments) of the table of bad requests sent to one operation."""
    admin = callers["admin"][0]
    url = _fill(path)
    table: list[tuple[str, str, dict[str, Any]]] = [("no token", url, {})]
    table += [
        (f"as {caller}, unknown names", _fill(path, node_id or None), {"headers": headers})
        for caller, (headers, node_id) in callers.items()
    ]
    table += [
        ("a body of the wrong shape", url, {"headers": admin, "json": {"bogus": [1, 2]}}),
        (
            "a body that is not JSON",
            url,
            {"headers": admin | {"content-type": "application/json"}, "content": b"{nope"},
        ),
        ("bad query values", url + "?limit=-1&wait=-5&before_epoch=0&deployment=" + "x" * 300, {"headers": admin}),
        ("names that are not names", _fill(path, value="Not%20A%20Name"), {"headers": admin}),
    ]
    limit, _what = BodyLimit(app=None, default_max_bytes=Settings().max_body_bytes).limit_for(method, url)  # type: ignore[arg-type]
    if limit <= _OVERSIZE_UP_TO:
        table.append(("a body over the limit", url, {"headers": admin, "content": b"x" * (limit + 1)}))
    return table


def test_every_route_answers_only_the_statuses_it_documents(
    cp_client: httpx.Client, callers: dict[str, tuple[dict[str, str], str]]
) -> None:
    operations = _operations(cp_client.get("/openapi.json").json())
    reached: dict[Operation, set[int]] = defaultdict(set)
    sent_oversized: dict[Operation, set[int]] = defaultdict(set)
    failures: list[str] = []
    for (method, path), operation in operations.items():
        documented = {int(s) for s in operation["responses"]}
        for what, url, arguments in _bad_requests(method, path, callers):
            response = cp_client.request(method, url, **arguments)
            if what == "a body over the limit":
                sent_oversized[(method, path)].add(413)
            reached[(method, path)].add(response.status_code)
            if response.status_code not in documented:
                failures.append(
                    f"{method} {path} ({what}): {response.status_code} is not documented: {response.text[:200]}"
                )
            elif response.status_code >= 400:
                try:
                    problem(response)
                except AssertionError as err:
                    failures.append(f"{method} {path} ({what}): not problem details: {err}")
    # Each route was driven into the documented statuses a generic bad request can reach.
    for (method, path), operation in operations.items():
        documented = {int(s) for s in operation["responses"]}
        contract = _contract(method, path)
        expected = {413} & sent_oversized[(method, path)]
        if contract is not None:
            expected.add(401)
            if contract != frozenset({"admin", "publisher", "operator", ENROL, NODE}) or "{node_id}" in path:
                expected.add(403)
        if 422 in documented and (method, path) not in _INTEGRITY_422:
            expected.add(422)
        if 404 in documented and method in ("GET", "DELETE") and "{" in path and contract is not None:
            expected.add(404)
        if missing := expected - reached[(method, path)]:
            failures.append(f"{method} {path} never answered {sorted(missing)} (got {sorted(reached[(method, path)])})")
    assert not failures, "\n".join(failures)


def test_framework_errors_are_problems(cp_client: httpx.Client, admin_headers: dict[str, str]) -> None:
    unknown = cp_client.get("/v1/no-such-thing", headers=admin_headers)
    assert unknown.status_code == 404
    assert problem(unknown)["code"] == "no_route"
    wrong_method = cp_client.patch("/v1/models", headers=admin_headers)
    assert wrong_method.status_code == 405
    assert problem(wrong_method)["code"] == "method_not_allowed"
    assert "GET" in wrong_method.headers["allow"]


def test_an_unexpected_failure_is_a_500_problem_naming_no_internals(tmp_path: Any) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'cp.db'}", store_url=f"local:{tmp_path / 'store'}")
    app = create_app(settings)

    @app.get("/v1/broken")
    def broken() -> None:
        raise RuntimeError("secret internals")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/v1/broken")
    assert response.status_code == 500
    body = problem(response)
    assert body["code"] == "internal"
    assert "secret internals" not in response.text
    assert "RuntimeError" in body["detail"]
