"""Who may call which route: the role contract restated, and callers holding every kind of token."""

from __future__ import annotations

import httpx
import pytest

from weightship.schemas import Role

ADMIN, PUBLISHER, OPERATOR, READ = Role.admin.value, Role.publisher.value, Role.operator.value, Role.read.value

#: an agent token bound to no node (it may only enrol one) and a node token (acts for its node only)
ENROL = "enrolment"


NODE = "node"


#: every caller with a token but an enrolment token, which can enrol and nothing else
ANY = frozenset({ADMIN, PUBLISHER, OPERATOR, READ, NODE})


def only(*callers: str) -> frozenset[str]:
    """``callers`` plus admin, who may do everything."""
    return frozenset(callers) | {ADMIN}


#: (method, path with parameters written ``{}``) -> callers admitted
ROLE_CONTRACT: dict[tuple[str, str], frozenset[str]] = {
    # publishing
    ("POST", "/v1/uploads"): only(PUBLISHER),
    ("GET", "/v1/uploads/{}"): only(PUBLISHER),
    ("PUT", "/v1/uploads/{}/blobs/{}/parts/{}"): only(PUBLISHER),
    ("POST", "/v1/uploads/{}/commit"): only(PUBLISHER),
    ("DELETE", "/v1/uploads/{}"): only(PUBLISHER),
    # registry
    ("GET", "/v1/models"): ANY,
    ("GET", "/v1/models/{}/versions"): ANY,
    ("GET", "/v1/models/{}/versions/{}"): ANY,
    ("GET", "/v1/models/{}/versions/{}/manifest"): ANY,
    ("POST", "/v1/models/{}/labels"): only(PUBLISHER),
    ("GET", "/v1/models/{}/versions/{}/signatures"): ANY,
    ("POST", "/v1/models/{}/versions/{}/signatures"): only(PUBLISHER),
    # deployments
    ("POST", "/v1/deployments"): only(OPERATOR),
    ("GET", "/v1/deployments"): ANY,
    ("GET", "/v1/deployments/{}"): ANY,
    ("PUT", "/v1/deployments/{}/pointer"): only(OPERATOR),
    ("POST", "/v1/deployments/{}/rollback"): only(OPERATOR),
    ("GET", "/v1/deployments/{}/history"): ANY,
    ("GET", "/v1/deployments/{}/status"): ANY,
    # preheats and warm pools
    ("PUT", "/v1/deployments/{}/warm-pool"): only(OPERATOR),
    ("DELETE", "/v1/deployments/{}/warm-pool"): only(OPERATOR),
    ("POST", "/v1/deployments/{}/preheats"): only(OPERATOR),
    ("GET", "/v1/deployments/{}/preheats"): ANY,
    ("DELETE", "/v1/deployments/{}/preheats/{}"): only(OPERATOR),
    # fleet
    ("POST", "/v1/nodes/enrol"): only(ENROL),
    ("POST", "/v1/nodes/register"): only(NODE),
    ("POST", "/v1/nodes/{}/heartbeat"): only(NODE),
    ("GET", "/v1/nodes/{}/desired"): only(NODE),
    ("PUT", "/v1/nodes/{}/assignment"): only(OPERATOR),
    ("PUT", "/v1/deployments/{}/assignment"): only(OPERATOR),
    # A node token (for blobs of versions its node is entitled to) and operators (read-only, for
    # inspecting a version's bytes); never an enrolment token.
    ("POST", "/v1/blobs/urls"): only(NODE, OPERATOR),
    ("GET", "/v1/nodes"): ANY,
    # tokens
    ("POST", "/v1/tokens"): only(ADMIN),
    ("GET", "/v1/tokens"): only(ADMIN),
    ("DELETE", "/v1/tokens/{}"): only(ADMIN),
    ("GET", "/v1/tokens/self"): ANY,
    # tickets: a ticket names the node it is issued to, so only a node token, not even an admin's
    ("POST", "/v1/tickets"): frozenset({NODE}),
    ("GET", "/v1/tickets/keys"): ANY,
    # rollouts: publishers may start one only where the deployment allows it (checked after the role)
    ("POST", "/v1/deployments/{}/rollouts"): only(OPERATOR, PUBLISHER),
    ("GET", "/v1/deployments/{}/rollouts"): ANY,
    ("GET", "/v1/deployments/{}/rollouts/{}"): ANY,
    ("POST", "/v1/deployments/{}/rollouts/{}/actions"): only(OPERATOR),
    ("GET", "/v1/rollouts"): ANY,
    # a built-in analysis measurement for a rollout driven outside (the Kubernetes operator)
    ("POST", "/v1/deployments/{}/analysis/builtin"): only(OPERATOR),
    # how the nodes' model servers fared loading a canary, for a rollout driven outside (the operator)
    ("GET", "/v1/deployments/{}/analysis/loads"): only(OPERATOR),
}


@pytest.fixture
def callers(cp_client: httpx.Client, role_headers: dict[Role, dict[str, str]]) -> dict[str, tuple[dict[str, str], str]]:
    """``Authorization`` headers per caller, with the id of the node a node token acts for ("" for others)."""
    enrolled = cp_client.post("/v1/nodes/enrol", json={"name": "contract-node"}, headers=role_headers[Role.agent])
    assert enrolled.status_code == 201, enrolled.text
    node = enrolled.json()
    found = {role.value: (headers, "") for role, headers in role_headers.items() if role != Role.agent}
    found[ENROL] = (role_headers[Role.agent], "")
    found[NODE] = ({"Authorization": f"Bearer {node['token']}"}, node["node"]["id"])
    return found
