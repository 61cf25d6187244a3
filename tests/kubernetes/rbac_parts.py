"""The Kubernetes API as a pod's service account sees it, for the RBAC and pod tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest_asyncio
import yaml

from tests.kubernetes.chart_parts import CHART, REQUIRED
from tests.kubernetes.conftest import OperatorProcess, VersionedEmulator
from tests.kubernetes.rbac import Audit, Rbac, ServiceAccountMount, tls_server
from weightship.testing import free_port

#: ``helm install weightship deploy/helm/weightship -n weightship`` (docs/kubernetes.md)
RELEASE = RELEASE_NAMESPACE = "weightship"


OPERATOR_SA = "weightship-operator"


#: Granted entries (apiGroup, resource, verb) that the runs here do not use, and why.
NEEDED_ELSEWHERE: dict[tuple[str, str, str], str] = {
    ("", "nodes", "get"): "the agent pod's node-labels init container reads its Node (test_chart.py::test_node_labels_become_agent_labels)",
}


def chart_objects(values: dict[str, Any] = REQUIRED) -> list[dict[str, Any]]:
    """Every object the chart renders for the docs' release and namespace."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def operator_chart_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The plain environment variables the chart gives the operator container."""
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


class InClusterApi:
    """kmock over TLS, RBAC enforced from the rendered chart, and ServiceAccount mounts for the processes under test."""

    def __init__(self, server: VersionedEmulator, tls: Any, ca: Path, workdir: Path) -> None:
        self.objects = chart_objects()
        self.audit = Audit(Rbac(self.objects))
        self.server = server
        self.tls = tls
        self.ca = ca
        self.workdir = workdir

    def mount(self, service_account: str) -> ServiceAccountMount:
        """A fresh token of ``service_account`` (release namespace) laid out as Kubernetes mounts it."""
        token = self.audit.token_for(RELEASE_NAMESPACE, service_account)
        return ServiceAccountMount.write(self.workdir / service_account, token, self.ca, RELEASE_NAMESPACE)

    def operator(self, cp_url: str, cp_token: str, identity: str, log_path: Path) -> OperatorProcess:
        """An operator process configured as the chart configures it, in-cluster (not started)."""
        process = OperatorProcess(self.server, cp_url, cp_token, identity, log_path)
        mount = self.mount(OPERATOR_SA)
        for name in ("WEIGHTSHIP_OPERATOR_KUBE_SERVER", "WEIGHTSHIP_OPERATOR_LEASE_NAMESPACE"):
            process.env.pop(name, None)
        process.env.update(operator_chart_env(self.objects))
        process.env.update(mount.env(self.tls))
        process.env.update({"WEIGHTSHIP_URL": cp_url, "POD_NAME": identity, "POD_NAMESPACE": RELEASE_NAMESPACE})
        # The chart's liveness port is per pod; processes sharing this host each need their own.
        process.env["WEIGHTSHIP_OPERATOR_LIVENESS"] = f"http://127.0.0.1:{free_port()}/healthz"
        return process

    def report(self) -> str:
        """What was denied and what went unused, for a failure message."""
        denied = "\n  ".join(sorted({str(a) for a in self.audit.denied}))
        unused = "\n  ".join(str(g) for g in self.audit.unused(NEEDED_ELSEWHERE))
        return f"denied:\n  {denied or '-'}\nunused:\n  {unused or '-'}"


@pytest_asyncio.fixture
async def in_cluster(kmock_server: VersionedEmulator, tmp_path: Path) -> AsyncIterator[InClusterApi]:
    """kmock also on HTTPS, with the chart's RBAC enforced on every request that carries a ServiceAccount token."""
    async with tls_server(kmock_server, tmp_path / "pki") as (tls, ca):
        api = InClusterApi(kmock_server, tls, ca, tmp_path / "serviceaccounts")
        kmock_server.authorize = api.audit.enforce
        yield api
        kmock_server.authorize = None
