"""Entitlement from the control plane's truth: what a node may read follows from what an admin assigned it.

Threat: a node holding its own node token (or anyone holding the shared enrolment token) reads a
model it was never given. It re-registers itself into another deployment, or as role ``cache``
(entitled to every pointer), or enrols a new "cache" with the nodes' enrolment token; or it asks
the control plane for origin blob URLs of another model's blobs. The rule: a node's deployments
are its enrolment token's scope (fixed at enrolment), its role is bound to the token minted for
that role, and tickets and blob URLs are issued only for what that makes it entitled to. A node
may still *say* which deployments it wants to follow (an agent staging what its pods ask for);
that gets it nothing it was not assigned. An unscoped enrolment token (the default, and the
chart's bootstrap token) assigns every deployment. Real control-plane process over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.agent.controlplane_process import ADMIN_TOKEN
from tests.agent.fleet import Fleet
from weightship.manifest import Manifest
from weightship.testing import problem

pytestmark = pytest.mark.timeout(120)

Headers = dict[str, str]


def _token(fleet: Fleet, name: str, **scope: object) -> Headers:
    """An enrolment token (role agent) minted by the admin over the API, with ``scope`` (deployments, node_role)."""
    body = {"name": name, "role": "agent", **scope}
    response = httpx.post(f"{fleet.cp.url}/v1/tokens", json=body, headers=_bearer(ADMIN_TOKEN), timeout=10)
    assert response.status_code == 201, response.text
    return _bearer(response.json()["token"])


def _bearer(token: str) -> Headers:
    return {"Authorization": f"Bearer {token}"}


def _enrol(fleet: Fleet, enrolment: Headers, name: str, *deployments: str, role: str = "node") -> httpx.Response:
    body = {"name": name, "deployments": list(deployments), "role": role}
    return httpx.post(f"{fleet.cp.url}/v1/nodes/enrol", json=body, headers=enrolment, timeout=10)


def _register(fleet: Fleet, node: Headers, name: str, *deployments: str, role: str = "node") -> httpx.Response:
    body = {"name": name, "deployments": list(deployments), "role": role}
    return httpx.post(f"{fleet.cp.url}/v1/nodes/register", json=body, headers=node, timeout=10)


def _ticket(fleet: Fleet, node: Headers, version: str) -> httpx.Response:
    return httpx.post(f"{fleet.cp.url}/v1/tickets", json={"versions": [version]}, headers=node, timeout=10)


def _urls(fleet: Fleet, headers: Headers, manifest: Manifest) -> httpx.Response:
    body = {"blobs": [f.sha256 for f in manifest.files]}
    return httpx.post(f"{fleet.cp.url}/v1/blobs/urls", json=body, headers=headers, timeout=10)


@pytest.fixture
def two_models(fleet: Fleet, model: str, make_model: Callable[..., Path]) -> tuple[str, Manifest, str, Manifest]:
    """Deployment ``<model>-chat`` of one model and ``<model>-secret`` of another, each at a stable version."""
    chat = fleet.publish(make_model("chat", tensors_mb=0.1, seed=21), f"{model}-a", "v1")
    secret = fleet.publish(make_model("secret", tensors_mb=0.1, seed=22), f"{model}-b", "v1")
    fleet.point(f"{model}-chat", f"{model}-a", "v1")
    fleet.point(f"{model}-secret", f"{model}-b", "v1")
    return f"{model}-chat", chat, f"{model}-secret", secret


def test_a_node_that_re_registers_into_another_deployment_still_cannot_read_its_model(
    fleet: Fleet, model: str, two_models: tuple[str, Manifest, str, Manifest]
) -> None:
    chat, chat_v1, secret, secret_v1 = two_models
    enrolment = _token(fleet, f"{model}-chat-only", deployments=[chat])
    enrolled = _enrol(fleet, enrolment, f"{model}-n1", chat)
    assert enrolled.status_code == 201, enrolled.text
    node = _bearer(enrolled.json()["token"])
    assert _ticket(fleet, node, chat_v1.digest).status_code == 200
    assert _urls(fleet, node, chat_v1).status_code == 200

    # It says it follows the other deployment too (accepted: a node may want what its pods ask for) ...
    assert _register(fleet, node, f"{model}-n1", chat, secret).status_code == 200
    # ... but what it was assigned is what it gets: no ticket, no blob URL for the other model.
    refused = _ticket(fleet, node, secret_v1.digest)
    assert refused.status_code == 403, refused.text
    assert secret_v1.digest in problem(refused)["detail"]
    urls = _urls(fleet, node, secret_v1)
    assert urls.status_code == 403, urls.text
    assert problem(urls)["code"] == "blob_not_entitled"
    # its own deployment still works
    assert _ticket(fleet, node, chat_v1.digest).status_code == 200


def test_a_node_cannot_make_itself_a_cache(
    fleet: Fleet, model: str, two_models: tuple[str, Manifest, str, Manifest]
) -> None:
    chat, _chat_v1, _secret, secret_v1 = two_models
    enrolment = _token(fleet, f"{model}-nodes", deployments=[chat])
    enrolled = _enrol(fleet, enrolment, f"{model}-n2", chat)
    assert enrolled.status_code == 201, enrolled.text
    node = _bearer(enrolled.json()["token"])

    as_cache = _register(fleet, node, f"{model}-n2", role="cache")
    assert as_cache.status_code == 403, as_cache.text
    assert problem(as_cache)["code"] == "role_fixed"
    assert _ticket(fleet, node, secret_v1.digest).status_code == 403
    assert _urls(fleet, node, secret_v1).status_code == 403

    # Nor can the nodes' enrolment token (scoped or the unscoped default) enrol a new "cache".
    for token in (enrolment, _bearer(fleet.agent_token)):
        sneaky = _enrol(fleet, token, f"{model}-fake-cache", role="cache")
        assert sneaky.status_code == 403, sneaky.text
        assert problem(sneaky)["code"] == "enrolment_role_refused"


def test_a_cache_is_bound_to_a_token_minted_for_caches_and_to_its_scope(
    fleet: Fleet, model: str, two_models: tuple[str, Manifest, str, Manifest]
) -> None:
    chat, chat_v1, _secret, secret_v1 = two_models
    scoped = _enrol(fleet, _token(fleet, f"{model}-cache-tok", deployments=[chat], node_role="cache"),
                    f"{model}-c1", role="cache")  # fmt: skip
    assert scoped.status_code == 201, scoped.text
    cache = _bearer(scoped.json()["token"])
    assert _ticket(fleet, cache, chat_v1.digest).status_code == 200
    assert _ticket(fleet, cache, secret_v1.digest).status_code == 403
    assert _urls(fleet, cache, secret_v1).status_code == 403
    # and it cannot turn itself into a node of the other deployment either
    assert _register(fleet, cache, f"{model}-c1", _secret, role="node").status_code == 403

    # an unscoped cache token: a cache serves the whole cluster, every pointer
    unscoped = _enrol(fleet, _bearer(fleet.cache_token), f"{model}-c2", role="cache")
    assert unscoped.status_code == 201, unscoped.text
    assert _ticket(fleet, _bearer(unscoped.json()["token"]), secret_v1.digest).status_code == 200


def test_an_enrolment_token_can_enrol_and_nothing_else(
    fleet: Fleet, model: str, two_models: tuple[str, Manifest, str, Manifest]
) -> None:
    chat, chat_v1, _secret, _secret_v1 = two_models
    enrolment = _bearer(fleet.agent_token)
    urls = _urls(fleet, enrolment, chat_v1)
    assert urls.status_code == 403, urls.text
    assert problem(urls)["code"] == "enrolment_token_cannot_act"
    for path in ("/v1/models", f"/v1/deployments/{chat}", "/v1/tickets/keys", "/v1/tokens/self",
                 f"/v1/models/{model}-a/versions/v1/manifest"):  # fmt: skip
        answer = httpx.get(f"{fleet.cp.url}{path}", headers=enrolment, timeout=10)
        assert answer.status_code == 403, f"{path}: {answer.status_code} {answer.text}"
    assert _ticket(fleet, enrolment, chat_v1.digest).status_code == 403
    assert _enrol(fleet, enrolment, f"{model}-n3", chat).status_code == 201


def test_an_admin_assigning_a_node_is_what_its_tickets_and_blob_urls_follow(
    fleet: Fleet, model: str, two_models: tuple[str, Manifest, str, Manifest]
) -> None:
    chat, chat_v1, secret, secret_v1 = two_models
    enrolled = _enrol(fleet, _token(fleet, f"{model}-pool", deployments=[chat]), f"{model}-n4", chat, secret)
    assert enrolled.status_code == 201, enrolled.text
    node_id, node = enrolled.json()["node"]["id"], _bearer(enrolled.json()["token"])
    assert enrolled.json()["node"]["assigned"] == [chat]
    assert _ticket(fleet, node, secret_v1.digest).status_code == 403

    admin = _bearer(ADMIN_TOKEN)
    url = f"{fleet.cp.url}/v1/nodes/{node_id}/assignment"
    assigned = httpx.put(url, json={"deployments": [secret]}, headers=admin, timeout=10)
    assert assigned.status_code == 200, assigned.text
    assert assigned.json()["assigned"] == [secret]
    assert _ticket(fleet, node, secret_v1.digest).status_code == 200
    assert _urls(fleet, node, secret_v1).status_code == 200
    assert _ticket(fleet, node, chat_v1.digest).status_code == 403  # no longer assigned
    # only an operator assigns: the node itself cannot
    assert httpx.put(url, json={"deployments": None}, headers=node, timeout=10).status_code == 403


def test_a_deployment_assigned_by_label_selector_reaches_the_nodes_enrolled_with_those_labels(
    fleet: Fleet, model: str, two_models: tuple[str, Manifest, str, Manifest]
) -> None:
    chat, _chat_v1, secret, secret_v1 = two_models
    enrolment = _token(fleet, f"{model}-racks", deployments=[chat])
    nodes = {}
    for name, rack in (("in", "r1"), ("out", "r2")):
        body = {"name": f"{model}-{name}", "deployments": [chat, secret], "labels": {"rack": rack}}
        enrolled = httpx.post(f"{fleet.cp.url}/v1/nodes/enrol", json=body, headers=enrolment, timeout=10)
        assert enrolled.status_code == 201, enrolled.text
        nodes[name] = _bearer(enrolled.json()["token"])
    assert _ticket(fleet, nodes["in"], secret_v1.digest).status_code == 403

    url = f"{fleet.cp.url}/v1/deployments/{secret}/assignment"
    assigned = httpx.put(url, json={"selector": {"rack": "r1"}}, headers=_bearer(ADMIN_TOKEN), timeout=10)
    assert assigned.status_code == 200, assigned.text
    assert _ticket(fleet, nodes["in"], secret_v1.digest).status_code == 200
    assert _urls(fleet, nodes["in"], secret_v1).status_code == 200
    assert _ticket(fleet, nodes["out"], secret_v1.digest).status_code == 403
    # A node cannot match a selector by re-registering with other labels: enrolment fixed them.
    moved = {"name": f"{model}-out", "deployments": [chat, secret], "labels": {"rack": "r1"}}
    assert httpx.post(f"{fleet.cp.url}/v1/nodes/register", json=moved, headers=nodes["out"], timeout=10).is_success
    assert _ticket(fleet, nodes["out"], secret_v1.digest).status_code == 403
    # selectors name node labels only
    bad = httpx.put(url, json={"selector": {"owner": "me"}}, headers=_bearer(ADMIN_TOKEN), timeout=10)
    assert bad.status_code == 400, bad.text


def test_one_corrupt_stored_manifest_withholds_only_its_own_blobs(
    fleet: Fleet, model: str, make_model: Callable[..., Path]
) -> None:
    v1 = fleet.publish(make_model("v1", tensors_mb=0.1, seed=31), f"{model}-c", "v1")
    v2 = fleet.publish(make_model("v2", tensors_mb=0.1, seed=32), f"{model}-c", "v2")
    fleet.point(f"{model}-chat", f"{model}-c", "v1")
    fleet.point(f"{model}-chat", f"{model}-c", "v2")  # the node is entitled to v2 (stable) and v1 (previous)
    stored = fleet.cp.workdir / "origin" / "manifests" / "sha256" / v1.digest.removeprefix("sha256:")
    stored.write_bytes(b'{"not": "a manifest"}')  # a bucket writer broke v1's manifest
    enrolled = _enrol(fleet, _token(fleet, f"{model}-chat-only", deployments=[f"{model}-chat"]), f"{model}-n", f"{model}-chat")
    assert enrolled.status_code == 201, enrolled.text
    node = _bearer(enrolled.json()["token"])

    assert _urls(fleet, node, v2).status_code == 200, "the sound version's blobs are still served"
    refused = _urls(fleet, node, v1)
    assert refused.status_code == 403, refused.text
    assert problem(refused)["code"] == "blob_not_entitled"
