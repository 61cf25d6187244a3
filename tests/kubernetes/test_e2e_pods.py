"""Pods that run: kmock as the API server, the process kubelet (``kubelet.py``) running each pod.

The kubelet's own behaviour first (a ReplicaSet's pods as processes, readiness from the probe,
processes stopped as pods go), then the Kubernetes path end to end.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from gpu_loader.modelgen import generate
from tests.gpu_loader.staged_versions import stage
from tests.kubernetes.conftest import NAMESPACE, VersionedEmulator
from tests.kubernetes.kubelet import Cluster, pod_ready
from weightship.testing import eventually_async

WAIT = 60.0


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A short scratch directory for the nodes' "hosts" (Unix socket paths must stay under ~100 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="kl-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture
async def cluster(kmock_server: VersionedEmulator, node_root: Path) -> AsyncIterator[Cluster]:
    """A ReplicaSet controller and the kubelet of node ``node-a``."""
    async with Cluster(str(kmock_server.url), node_root, ["node-a"], extra_env={"OMP_NUM_THREADS": "1"}) as running:
        yield running


def serving_replicaset(replicas: int, version: str) -> dict[str, Any]:
    """A ReplicaSet of ``weightship-serve --version-dir`` pods reading a model from a hostPath."""
    labels = {"app": "tiny"}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": "tiny", "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [{
                        "name": "server", "image": "weightship-serve:ignored",
                        "command": ["weightship-serve"],
                        "args": ["--version-dir", "$(MODEL_DIR)", "--port", "8000", "--device", "cpu"],
                        "env": [{"name": "MODEL_DIR", "value": f"/models/versions/{version}"}],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 1},
                        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                    }],
                    "volumes": [{"name": "models", "hostPath": {"path": "/srv/models", "type": "Directory"}}],
                },
            },
        },
    }  # fmt: skip


async def replicaset_status(server: VersionedEmulator) -> dict[str, Any]:
    answer = await server.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/tiny")
    assert answer.status == 200
    status: dict[str, Any] = (await answer.json()).get("status") or {}
    return status


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_kubelet_runs_a_replicasets_pods_as_processes_and_stops_each_as_its_pod_goes(
    kmock_server: VersionedEmulator, cluster: Cluster, tmp_path: Path
) -> None:
    generate(tmp_path / "tiny", size_mb=1, seed=5)
    version = stage(tmp_path / "tiny", cluster.kubelets["node-a"].host_path("/srv/models")).name
    body = serving_replicaset(2, version)
    answer = await kmock_server.post(f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets", json=body)
    assert answer.status in (200, 201), await answer.text()


    async def two_ready() -> bool:
        return (await replicaset_status(kmock_server)).get("readyReplicas") == 2

    try:
        await eventually_async(two_ready, WAIT, "two ready replicas")
    except AssertionError as exc:
        logs = {p["metadata"]["name"]: cluster.log(p["metadata"]["name"])[-2000:] for p in await cluster.pods(NAMESPACE)}
        raise AssertionError(f"{exc}; pod logs: {logs}") from None
    pods = await cluster.pods(NAMESPACE)
    assert len(pods) == 2
    assert all(pod_ready(p) for p in pods)
    assert {p["spec"]["nodeName"] for p in pods} == {"node-a"}
    urls = {cluster.endpoint(p["metadata"]["name"]) for p in pods}
    assert len(urls) == 2  # each pod its own port
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            assert (await http.get(url + "/readyz")).status_code == 200
    kubelet = cluster.kubelets["node-a"]
    processes = [c.proc for run in kubelet.runs.values() for c in run.main]

    # Scale to 1: one pod deleted, its process stopped; the other keeps answering.
    answer = await kmock_server.patch(
        f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/tiny", json={"spec": {"replicas": 1}}
    )
    assert answer.status == 200
    await eventually_async(lambda: len(kubelet.runs) == 1, WAIT, "one pod left on the node")
    await eventually_async(lambda: sum(p is not None and p.poll() is None for p in processes) == 1, WAIT, "one process")

    # The ReplicaSet deleted: its pod is garbage-collected and its process stopped.
    answer = await kmock_server.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/tiny")
    assert answer.status == 200
    await eventually_async(lambda: not kubelet.runs, WAIT, "no pod left on the node")
    assert all(p is None or p.poll() is not None for p in processes)
    assert await cluster.pods(NAMESPACE) == []
