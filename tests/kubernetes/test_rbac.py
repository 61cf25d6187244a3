"""The chart's RBAC, enforced as the API server does, on what the operator really sends (``rbac.py``).

The chart is rendered by Helm's Go SDK with the release name and namespace of
``docs/kubernetes.md`` (``helm install weightship ... -n weightship``) and the values with no safe
default. The operator runs as a process with in-cluster configuration: a ServiceAccount token
and CA laid out as Kubernetes mounts them, ``KUBERNETES_SERVICE_HOST``/``_PORT`` pointing at kmock
served over TLS. kmock refuses every request the chart does not allow (403), as an API server
would; afterwards every granted rule must have been used, except those listed in
:data:`NEEDED_ELSEWHERE` with the reason the run does not take their path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controlplane.k8s.kube import InCluster
from tests.kubernetes.conftest import VersionedEmulator, Webhook
from tests.kubernetes.rbac import Rbac, attributes
from tests.kubernetes.rbac_parts import NEEDED_ELSEWHERE, OPERATOR_SA, RELEASE_NAMESPACE, InClusterApi, chart_objects
from tests.kubernetes.rollout_parts import WAIT, analysis, apply, deployed, replicasets, rollout, status
from weightship.testing import eventually_async

AGENT_SA = "weightship-agent"


# --- the evaluator ---------------------------------------------------------------------------------

OPERATOR = ("system:serviceaccount:weightship:weightship-operator",
            ("system:serviceaccounts", "system:serviceaccounts:weightship", "system:authenticated"))  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "params", "expected"),
    [
        ("GET", "/apis/weightship.io/v1alpha1/modelrollouts", {"watch": "true"},
         {"verb": "watch", "api_group": "weightship.io", "resource": "modelrollouts", "namespace": ""}),
        ("GET", "/apis/apps/v1/namespaces/models/replicasets", {"labelSelector": "a=b"},
         {"verb": "list", "resource": "replicasets", "namespace": "models", "name": ""}),
        ("PATCH", "/apis/weightship.io/v1alpha1/namespaces/models/modelrollouts/chat/status", {},
         {"verb": "patch", "resource": "modelrollouts", "subresource": "status", "name": "chat"}),
        ("GET", "/api/v1/namespaces/weightship", {}, {"verb": "get", "resource": "namespaces", "name": "weightship"}),
        ("DELETE", "/api/v1/namespaces/models/pods", {}, {"verb": "deletecollection", "resource": "pods"}),
        ("PUT", "/apis/coordination.k8s.io/v1/namespaces/weightship/leases/op", {},
         {"verb": "update", "api_group": "coordination.k8s.io", "resource": "leases", "name": "op"}),
        ("GET", "/api/v1/pods", {"fieldSelector": "metadata.name=p"}, {"verb": "list", "name": "p", "namespace": ""}),
        ("GET", "/apis/apps/v1", {}, {"verb": "get", "resource_request": False}),
    ],
)  # fmt: skip
def test_requests_become_the_attributes_the_api_server_authorizes(
    method: str, path: str, params: dict[str, str], expected: dict[str, Any]
) -> None:
    attrs = attributes(method, path, params, *OPERATOR)
    assert {key: getattr(attrs, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("method", "path", "params", "allowed"),
    [
        ("GET", "/apis/weightship.io/v1alpha1/modelrollouts", {"watch": "true"}, True),  # ClusterRoleBinding
        ("PATCH", "/apis/weightship.io/v1alpha1/namespaces/models/modelrollouts/chat/status", {}, True),
        ("DELETE", "/apis/weightship.io/v1alpha1/namespaces/models/modelrollouts/chat", {}, False),
        ("POST", "/apis/apps/v1/namespaces/models/replicasets", {}, True),
        ("DELETE", "/apis/apps/v1/namespaces/models/replicasets", {}, False),  # deletecollection is not delete
        ("PATCH", "/apis/apps/v1/namespaces/models/replicasets/chat-1/scale", {}, False),  # a subresource is its own
        ("PATCH", "/apis/coordination.k8s.io/v1/namespaces/weightship/leases/weightship-operator", {}, True),
        ("PATCH", "/apis/coordination.k8s.io/v1/namespaces/models/leases/weightship-operator", {}, False),  # Role
        ("GET", "/api/v1/secrets", {}, False),
        ("GET", "/apis", {}, True),  # discovery: every authenticated user (system:discovery)
    ],
)  # fmt: skip
def test_the_chart_grants_the_operator_what_a_rule_names_in_the_namespace_its_binding_covers(
    method: str, path: str, params: dict[str, str], allowed: bool
) -> None:
    rbac = Rbac(chart_objects())
    assert bool(rbac.authorize(attributes(method, path, params, *OPERATOR))) is allowed


def test_resource_names_narrow_a_rule_to_named_objects_and_never_allow_create() -> None:
    role = {"kind": "Role", "metadata": {"name": "r", "namespace": "ns"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["one"],
                       "verbs": ["get", "list", "create"]}]}  # fmt: skip
    binding = {"kind": "RoleBinding", "metadata": {"name": "b", "namespace": "ns"},
               "roleRef": {"kind": "Role", "name": "r"},
               "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": "ns"}]}  # fmt: skip
    rbac = Rbac([role, binding])
    user = ("system:serviceaccount:ns:sa", ("system:authenticated",))

    def allowed(method: str, path: str, params: dict[str, str] | None = None) -> bool:
        return bool(rbac.authorize(attributes(method, path, params or {}, *user)))

    assert allowed("GET", "/api/v1/namespaces/ns/configmaps/one")
    assert not allowed("GET", "/api/v1/namespaces/ns/configmaps/two")
    assert not allowed("GET", "/api/v1/namespaces/ns/configmaps")
    assert allowed("GET", "/api/v1/namespaces/ns/configmaps", {"fieldSelector": "metadata.name=one"})
    assert not allowed("POST", "/api/v1/namespaces/ns/configmaps")
    assert not allowed("GET", "/api/v1/namespaces/other/configmaps/one")


def test_every_serviceaccount_the_chart_binds_rules_to_exists_in_the_chart() -> None:
    objects = chart_objects()
    rbac = Rbac(objects)
    for binding in rbac.bindings:
        for subject in binding.subjects:
            if subject.get("kind") == "ServiceAccount":
                assert (subject["namespace"], subject["name"]) in rbac.service_accounts, binding.name
    assert {(RELEASE_NAMESPACE, OPERATOR_SA), (RELEASE_NAMESPACE, AGENT_SA)} <= rbac.service_accounts


def test_in_cluster_configuration_needs_the_service_host_and_a_mounted_token(tmp_path: Path) -> None:
    mounted = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443",
               "WEIGHTSHIP_KUBE_SERVICE_ACCOUNT_DIR": str(tmp_path)}  # fmt: skip
    assert InCluster.from_env(mounted) is None  # no token file: not in a pod
    (tmp_path / "token").write_text("t0ken\n")
    found = InCluster.from_env(mounted)
    assert found is not None
    assert (found.server, found.token(), found.ca_path) == ("https://10.0.0.1:443", "t0ken", tmp_path / "ca.crt")
    assert InCluster.from_env({**mounted, "KUBERNETES_SERVICE_HOST": ""}) is None
    assert InCluster.from_env({**mounted, "KUBERNETES_SERVICE_HOST": "fd00::1"}).server == "https://[fd00::1]:443"  # type: ignore[union-attr]


# --- the operator, in-cluster, against the chart's RBAC --------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("replicaset_controller")
async def test_the_operator_runs_in_cluster_and_every_request_it_sends_is_one_the_chart_allows(
    kmock_server: VersionedEmulator,
    in_cluster: InClusterApi,
    controlplane: tuple[str, dict[str, str]],
    operator_token: str,
    webhook: Webhook,
    tmp_path: Path,
) -> None:
    cp_url, digests = controlplane
    operator = in_cluster.operator(cp_url, operator_token, "op-in-cluster", tmp_path / "operator.log")
    operator.start()
    try:
        window = {"rollbackWindowSeconds": 1, "scaleDownDelaySeconds": 0}
        await apply(kmock_server, rollout("v1", [], **window))
        await deployed(kmock_server, digests["v1"])
        webhook.answers = [{"value": 0.001}]
        await apply(kmock_server, rollout("v2", [{"setWeight": 25}, analysis(webhook.url), {"setWeight": 50}], **window))
        await deployed(kmock_server, digests["v2"])
        # the previous ReplicaSet is deleted once the 1 s window passed
        await eventually_async(lambda: digests["v1"] not in replicasets(kmock_server), WAIT, "v1's ReplicaSet to go")
        webhook.answers = [{"value": 0.5}]
        await apply(kmock_server, rollout("v3", [{"setWeight": 25}, analysis(webhook.url)], **window))
        await eventually_async(lambda: status(kmock_server).get("phase") == "Degraded", WAIT, "v3 rolled back")
    finally:
        operator.stop()
    log = operator.log()
    assert in_cluster.audit.requests > 0, f"the operator sent no request with its ServiceAccount token:\n{log[-3000:]}"
    assert not in_cluster.audit.denied, in_cluster.report()
    assert not in_cluster.audit.unused(NEEDED_ELSEWHERE), in_cluster.report()

