"""Every ``/v1`` route admits exactly the callers the API contract gives it, and nobody without a token.

The contract is the route list in ``weightship/schemas/__init__.py``; ``ROLE_CONTRACT`` restates it. The
tests iterate the app's own route table, so routes added later are covered automatically: a
``/v1`` route missing from the contract fails ``test_every_v1_route_has_a_role_contract`` until
someone decides who may call it.

Callers are the roles, with ``agent`` split in two: an enrolment token (``ENROL``, bound to no
node) and a node token (``NODE``). On routes naming a node (``{node_id}``) ``NODE`` means that
node's own token; the same token on another node's route must get 403.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

import fastapi.routing
import httpx
import pytest

from controlplane.app import create_app
from controlplane.settings import Settings
from tests.controlplane.auth_parts import ANY, ENROL, NODE, ROLE_CONTRACT
from tests.controlplane.conftest import problem
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(120)

AGENT = (ENROL, NODE)


#: routes authorised by an HMAC-signed URL instead of a token: a bad signature is refused whoever asks
SIGNED_ROUTES: frozenset[tuple[str, str]] = frozenset({("GET", "/v1/blobs/{}"), ("HEAD", "/v1/blobs/{}")})

_PARAM = re.compile(r"\{[^}]+\}")


def _v1_routes() -> list[tuple[str, str]]:
    """(method, path template) of every ``/v1`` route the app serves.

    FastAPI >= 0.160 keeps included routers as lazy branches in ``app.routes``; its
    ``iter_route_contexts`` flattens them. The OpenAPI document is a second, independent listing.
    """
    app = create_app(Settings(database_url="sqlite://", admin_token=""))
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    routes: Iterable[Any] = flatten(app.routes) if flatten is not None else app.routes
    found = {
        (method, str(route.path))
        for route in routes
        if str(getattr(route, "path", "")).startswith("/v1/")
        for method in (getattr(route, "methods", None) or ())
        if method != "HEAD"
    }
    with warnings.catch_warnings():
        # Only the paths matter here; schema warnings (e.g. duplicate operation ids) are not ours to judge.
        warnings.simplefilter("ignore", UserWarning)
        paths = app.openapi()["paths"]
    for path, operations in paths.items():
        if path.startswith("/v1/"):
            found.update((method.upper(), path) for method in operations)
    return sorted(found)


def _contract_key(method: str, path: str) -> tuple[str, str]:
    return method, _PARAM.sub("{}", path)


def _concrete(path: str, node_id: str | None = None) -> str:
    """A requestable path: ``{node_id}`` filled with ``node_id`` if given, every other parameter with a value no row has."""
    if node_id is not None:
        path = path.replace("{node_id}", node_id)
    return _PARAM.sub("0" * 64, path)


def test_every_v1_route_has_a_role_contract() -> None:
    missing = [
        f"{m} {p}" for m, p in _v1_routes() if _contract_key(m, p) not in ROLE_CONTRACT | dict.fromkeys(SIGNED_ROUTES)
    ]
    assert not missing, f"routes without a role contract (add them to ROLE_CONTRACT): {missing}"


def test_the_route_table_is_not_empty() -> None:
    # Guards the other tests against passing vacuously if route discovery breaks.
    routes = {_contract_key(m, p) for m, p in _v1_routes()}
    assert ("PUT", "/v1/deployments/{}/pointer") in routes
    assert ("GET", "/v1/nodes/{}/desired") in routes


def test_every_v1_route_enforces_its_roles(
    cp_client: httpx.Client, callers: dict[str, tuple[dict[str, str], str]]
) -> None:
    failures: list[str] = []
    routes = [(m, p) for m, p in _v1_routes() if _contract_key(m, p) in ROLE_CONTRACT]
    assert set(callers) == ANY | {ENROL}
    for method, path in routes:
        url = _concrete(path)
        allowed = ROLE_CONTRACT[_contract_key(method, path)]
        anonymous = cp_client.request(method, url)
        if anonymous.status_code != 401:
            failures.append(f"{method} {path} without a token: {anonymous.status_code}, want 401")
        elif problem(anonymous)["code"] != "token_missing":
            failures.append(f"{method} {path} without a token: body {anonymous.text}")
        for caller, (headers, node_id) in callers.items():
            status = cp_client.request(method, _concrete(path, node_id or None), headers=headers).status_code
            if caller in allowed and status in (401, 403):
                failures.append(f"{method} {path} as {caller}: {status}, want it admitted")
            if caller not in allowed and status != 403:
                failures.append(f"{method} {path} as {caller}: {status}, want 403")
            if node_id and "{node_id}" in path:
                other = cp_client.request(method, url, headers=headers).status_code
                if other != 403:
                    failures.append(f"{method} {path} as {caller} for another node: {other}, want 403")
    assert not failures, "\n".join(failures)


def test_signed_routes_refuse_a_bad_signature_whatever_the_token(
    cp_client: httpx.Client, callers: dict[str, tuple[dict[str, str], str]]
) -> None:
    failures: list[str] = []
    routes = [(m, p) for m, p in _v1_routes() if _contract_key(m, p) in SIGNED_ROUTES]
    for method, path in routes:
        url = _concrete(path)
        params = {"expires": "4102444800", "sig": "0" * 64}
        for who, headers in [("nobody", {}), *((c, h) for c, (h, _node) in callers.items())]:
            status = cp_client.request(method, url, params=params, headers=headers).status_code
            if status != 403:
                failures.append(f"{method} {path} with a bad signature as {who}: {status}, want 403")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (None, "no header"),
        ("Bearer ws_not-a-real-token", "unknown token"),
        ("Basic dXNlcjpwYXNz", "wrong scheme"),
        ("Bearer", "scheme without a token"),
    ],
)
def test_bad_credentials_get_401_with_a_bearer_challenge(cp_client: httpx.Client, header: str | None, why: str) -> None:
    headers = {"Authorization": header} if header is not None else {}
    response = cp_client.get("/v1/deployments", headers=headers)
    assert response.status_code == 401, why
    assert response.headers["www-authenticate"] == "Bearer"
    assert problem(response)["code"] in ("token_missing", "token_malformed", "token_invalid")
    assert problem(response)["detail"]


def test_wrong_role_gets_403_naming_the_roles_needed(
    cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]]
) -> None:
    response = cp_client.post("/v1/deployments", json={"name": "d", "model": "m"}, headers=role_headers[Role.agent])
    assert response.status_code == 403
    body = problem(response)
    assert body["code"] == "role_refused"
    assert "operator" in body["detail"]
    assert "agent" in body["detail"]
