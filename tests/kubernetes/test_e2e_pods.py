"""Pods that run: kmock as the API server, the process kubelet (``kubelet.py``) running each pod.

The kubelet's own behaviour first (a ReplicaSet's pods as processes, readiness from the probe,
processes stopped as pods go), then the Kubernetes path end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import pytest_asyncio

from controlplane.k8s.rollout import ANNOTATION_DIGEST
from gpu_loader.modelgen import generate
from tests.agent.agent_processes import AgentProcess
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.gpu_loader.staged_versions import stage
from tests.kubernetes.conftest import NAMESPACE, VersionedEmulator
from tests.kubernetes.kubelet import Cluster, expand_vars, map_paths, map_ports, pod_ready
from tests.kubernetes.rbac_parts import NEEDED_ELSEWHERE, InClusterApi
from tests.kubernetes.rollout_parts import apply, replicasets, status, verb
from weightship.schemas import NodeCounters, NodeHeartbeat
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
    plain = str(kmock_server.servers[0].url)  # the HTTP server (a TLS one may join it: rbac.tls_server)
    env = {"OMP_NUM_THREADS": "1", "WEIGHTSHIP_WAIT_INTERVAL": "0.2"}
    async with Cluster(plain, node_root, ["node-a"], extra_env=env) as running:
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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unix:/run/weightship/agent.sock", "unix:/n/run/weightship/agent.sock"),
        ("/run/weightship", "/n/run/weightship"),
        ("/run/weightshipper/x", "/run/weightshipper/x"),  # another directory that only starts alike
        ("/var/run/weightship", "/var/run/weightship"),  # the mount path inside another path
        ("--dir=/data/m", "--dir=/pod/empty/m"),
    ],
)
def test_the_kubelet_maps_mount_paths_where_they_start_a_path(text: str, expected: str) -> None:
    mounts = [("/run/weightship", "/n/run/weightship"), ("/data", "/pod/empty")]
    assert map_paths(text, mounts) == expected


def test_the_kubelet_gives_each_declared_port_its_own_and_expands_variables_as_kubernetes_does() -> None:
    ports = {8000: 41234}
    assert map_ports(["--port", "8000", "--port=8000", "--port", "9000"], ports) == [
        "--port", "41234", "--port=41234", "--port", "9000"
    ]  # fmt: skip
    env = {"DIR": "/models", "N": "2"}
    assert expand_vars("$(DIR)/v$(N) $(UNSET) $$(DIR)", env) == "/models/v2 $(UNSET) $(DIR)"


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


# --- the Kubernetes path end to end ----------------------------------------------------------------

SOCKET_DIR = "/run/weightship"  # the chart's agent.socketDir and hostDataDir (defaults)
DATA_DIR = "/var/lib/weightship"
PROMPT = {"input_ids": [[5, 17, 42, 7, 99, 3, 64, 12]], "max_new_tokens": 2}
E2E_WAIT = 180.0


def judged_analysis() -> dict[str, Any]:
    """The canary judged against stable on the model servers' own counters (the built-in provider), by digest.

    ``golden``: any failed validation of the canary fails the rollout; ``error-rate``: its 5xx rate may
    exceed stable's by at most 5 points, over at least 5 requests each.
    """
    timing = {"initialDelay": "1s", "interval": "2s", "count": 4, "inconclusiveLimit": 8}
    golden = {"metric": "validation", "window": "20s", "timeout": "1s"}
    errors = {"metric": "errorRate", "minRequests": 5, "window": "20s", "timeout": "1s"}
    return {"analysis": {"metrics": [
        {"name": "golden", "provider": {"builtin": golden}, "failureCondition": "result['canary_failed'] > 0", **timing},
        {"name": "error-rate", "provider": {"builtin": errors}, "successCondition": "result['delta'] <= 0.05", **timing},
    ]}}  # fmt: skip


def model_rollout(version: str, steps: list[Any]) -> dict[str, Any]:
    """ModelRollout ``chat`` of deployment chat-prod: 2 pods of ``weightship-serve`` pinned by the operator's env."""
    server = {
        "name": "server", "image": "weightship-serve:0.1.0",
        "command": ["weightship-serve"],
        "args": ["--agent", f"unix:{SOCKET_DIR}/agent.sock", "--port", "8000", "--host", "127.0.0.1",
                 "--device", "cpu", "--workers", "1", "--poll-seconds", "2", "--metrics-push-seconds", "0.2"],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 1},
    }  # fmt: skip
    return {
        "apiVersion": "weightship.io/v1alpha1",
        "kind": "ModelRollout",
        "metadata": {"name": "chat", "namespace": NAMESPACE},
        "spec": {
            "deployment": "chat-prod",
            "version": version,
            "replicas": 2,
            "rollbackWindowSeconds": 600,
            "template": {"metadata": {"labels": {"app": "chat"}}, "spec": {"containers": [server]}},
            "steps": steps,
        },
    }


class Traffic:
    """Clients of the model-server pods: every ready pod is asked every 0.1 s; every answer is kept."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.http = httpx.AsyncClient(timeout=10)
        #: (pod name, the digest its pod was made for, the digest it answered with or the HTTP status)
        self.answers: list[tuple[str, str, str]] = []
        self._task: asyncio.Task[None] | None = None

    async def ask(self, pod: dict[str, Any]) -> tuple[str, str, str] | None:
        """One generate request to ``pod``; None if the kubelet does not run it (any more)."""
        name = pod["metadata"]["name"]
        made_for = pod["metadata"]["annotations"][ANNOTATION_DIGEST]
        try:
            url = self.cluster.endpoint(name)
            answer = await self.http.post(url + "/v1/generate", json=PROMPT)
            got = str(answer.json()["digest"]) if answer.status_code == 200 else f"HTTP {answer.status_code}"
        except (KeyError, ValueError, httpx.TransportError):  # not (or no longer) run by a kubelet, or stopping
            return None
        self.answers.append((name, made_for, got))
        return name, made_for, got

    async def survey(self) -> dict[str, tuple[str, str]]:
        """pod -> (made for, answered with), one request to every ready pod now."""
        out = {}
        for pod in await self.cluster.pods(NAMESPACE):
            if pod_ready(pod) and (found := await self.ask(pod)) is not None:
                out[found[0]] = found[1:]
        return out

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, httpx.HTTPError, ValueError):  # a pod going away mid-request
                await self.survey()
            await asyncio.sleep(0.1)  # ok-sleep: the clients' request rate

    def start(self) -> None:
        """Keep asking in the background."""
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop asking."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.http.aclose()


async def agent_counters(socket: Path) -> NodeCounters:
    """The agent's byte counters, from its local API on the node's socket."""
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket)), timeout=10) as http:
        answer = await http.get("http://agent/local/v1/status")
        answer.raise_for_status()
        return NodeHeartbeat.model_validate_json(answer.content).counters


async def settled(
    server: VersionedEmulator, digest: str, what: str, seen: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Wait until ``digest`` is stable and the rollout Healthy; keeps every status seen in ``seen``."""

    def probe() -> dict[str, Any] | None:
        current = status(server)
        assert current.get("phase") != "Invalid", current.get("message")
        if seen is not None:
            seen.append(current)
        return current if current.get("phase") == "Healthy" and current.get("stable") == digest else None

    try:
        return await eventually_async(probe, E2E_WAIT, what, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {status(server)}") from None


def measured(statuses: list[dict[str, Any]], metric: str) -> list[Any]:
    """Every value the analysis measured for ``metric`` in the statuses seen."""
    values: list[Any] = []
    for seen in statuses:
        for run in (seen.get("engine") or {}).get("analysisRuns") or []:
            for m in run.get("metrics") or []:
                if m["name"] == metric:
                    values.extend(x["value"] for x in m.get("measurements") or [] if x.get("value") is not None)
    return values


async def diagnosis(server: VersionedEmulator, cluster: Cluster, operator: Any, agent: AgentProcess | None) -> str:
    """What a failure needs: the rollout's status, the pods and their logs, the operator's and the agent's logs."""
    lines = [f"status: {status(server)}", f"replicasets: {replicasets(server)}"]
    for pod in await cluster.pods(NAMESPACE):
        name = pod["metadata"]["name"]
        statuses = (pod.get("status") or {}).get("initContainerStatuses", []) + (pod.get("status") or {}).get(
            "containerStatuses", []
        )
        lines.append(f"pod {name} ready={pod_ready(pod)} {[(c['name'], c['state']) for c in statuses]}")
        for container in ("weightship-wait-for-version", "server"):
            with contextlib.suppress(KeyError):
                lines.append(f"  {container}: {cluster.log(name, container)[-1500:]}")
    if operator is not None:
        lines.append(f"operator: {operator.log()[-3000:]}")
    if agent is not None:
        lines.append(f"agent: {agent.log()[-3000:]}")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_modelrollout_pods_serve_their_own_version_through_a_judged_canary_an_automatic_and_a_cli_rollback(
    kmock_server: VersionedEmulator,
    in_cluster: InClusterApi,  # the fixture imported above
    cluster: Cluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_SERVE_SAMPLE_SECONDS", "0.5")
    kubelet = cluster.kubelets["node-a"]
    socket = kubelet.host_path(SOCKET_DIR) / "agent.sock"
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agent: AgentProcess | None = None
    operator = None
    traffic = Traffic(cluster)
    try:
        await cp.ready()
        generate(tmp_path / "m1", size_mb=2, seed=21)
        generate(tmp_path / "m2", size_mb=2, seed=21, variant=1)
        generate(tmp_path / "m3", size_mb=2, seed=21, variant=2, corrupt="nan")
        with cp.client() as admin:
            v1, v2, v3 = (
                admin.publish_directory(tmp_path / f"m{i}", "chat", [f"v{i}"]).version.digest for i in (1, 2, 3)
            )
            admin.create_deployment("chat-prod", "chat")
            agent_token = admin.create_token("node-a", "agent").token
            operator_token = admin.create_token("operator", "operator").token

        # The node's agent, as the chart runs it: its data and its socket in the node's host paths, no deployments.
        kubelet.host_path(SOCKET_DIR).mkdir(parents=True, exist_ok=True)
        agent = AgentProcess(tmp_path, "node-a", cp.url, agent_token, [], extra=["--local-api", f"unix:{socket}"])
        agent.data_dir = kubelet.host_path(DATA_DIR)
        agent.start()
        await agent.ready()
        operator = in_cluster.operator(cp.url, operator_token, "op-e2e", tmp_path / "operator.log")
        operator.start()
        traffic.start()

        # v1: two pods, both answering with v1.
        await apply(kmock_server, model_rollout("v1", []))
        await settled(kmock_server, v1, "v1 stable with ready pods")
        first = await traffic.survey()
        assert len(first) == 2
        assert {made_for for made_for, _ in first.values()} == {v1}
        assert {got for _, got in first.values()} == {v1}

        # v2 with a canary step: a canary pod answers with v2, the stable pod with v1, on the same node.
        await apply(kmock_server, model_rollout("v2", [{"setWeight": 50}, {"pause": {}}, judged_analysis()]))

        async def split() -> dict[str, tuple[str, str]] | None:
            assert status(kmock_server).get("phase") != "Invalid", status(kmock_server).get("message")
            found = await traffic.survey()
            made = sorted(made_for for made_for, _ in found.values())
            return found if status(kmock_server).get("phase") == "Paused" and made == sorted([v1, v2]) else None

        canary_step = await eventually_async(split, E2E_WAIT, "one ready canary pod and one ready stable pod")
        assert all(made_for == got for made_for, got in canary_step.values()), canary_step
        assert status(kmock_server)["canary"] == v2

        # On: the analysis judges the two pods' counters (by digest) and promotes v2.
        seen: list[dict[str, Any]] = []
        await verb(kmock_server, "promote")
        await settled(kmock_server, v2, "v2 promoted by the analysis", seen)
        judged = [v for v in measured(seen, "error-rate") if isinstance(v, dict)]
        assert judged, f"no error-rate measurement in {seen[-1]}"
        assert judged[-1]["canary_requests"] >= 5
        assert judged[-1]["stable_requests"] >= 5
        promoted = await eventually_async(
            lambda: (s := replicasets(kmock_server)) and s[v2]["replicas"] == 2 and s, E2E_WAIT, "v2 at full size"
        )
        assert promoted[v1]["role"] == "previous"  # kept scaled for the rollback window
        v1_pods = {n for n, (made_for, _) in (await traffic.survey()).items() if made_for == v1}

        # v3 (NaNs in one tensor): its canary pod fails validation; the rollout rolls back by itself, at
        # once: the pod's model server counts the refusal, its agent heartbeats it, the operator aborts.
        # The progress deadline (600 s by default) is not what ends it.
        broken = model_rollout("v3", [{"setWeight": 50}, judged_analysis()])
        applied = asyncio.get_running_loop().time()
        await apply(kmock_server, broken)
        degraded = await eventually_async(
            lambda: (s := status(kmock_server)).get("phase") == "Degraded" and s, E2E_WAIT, "v3 rolled back"
        )
        took = asyncio.get_running_loop().time() - applied
        assert degraded["engine"]["abortReason"] == "CanaryRefused", degraded
        assert "CanaryRefused" in degraded["message"], degraded
        assert "node-a: its model servers refused the version" in degraded["message"], degraded
        assert took < 60, f"v3 rolled back {took:.0f}s after it was applied"
        assert (degraded["stable"], degraded.get("canary")) == (v2, None)
        await eventually_async(
            lambda: replicasets(kmock_server).get(v3, {"replicas": 0})["replicas"] == 0, E2E_WAIT, "v3's pods gone"
        )
        await eventually_async(
            lambda: not [p for p in kubelet.running() if v3.removeprefix("sha256:")[:10] in p], E2E_WAIT,
            "v3's pod stopped on the node",
        )  # fmt: skip
        after = await traffic.survey()
        assert v3 not in {got for _, got in after.values()}
        assert v3 not in {got for _, _, got in traffic.answers}, "a pod answered with v3"

        # `weightship rollback` inside the window: v1's pods, kept running, serve at once; nothing is downloaded.
        before = (await agent_counters(socket)).bytes_downloaded
        rollback = await asyncio.to_thread(
            subprocess.run,
            [str(Path(sys.executable).parent / "weightship"), "rollback", "chat-prod", "--reason", "e2e"],
            env={**os.environ, "WEIGHTSHIP_URL": cp.url, "WEIGHTSHIP_TOKEN": ADMIN_TOKEN},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert rollback.returncode == 0, rollback.stderr
        back = await eventually_async(
            lambda: (s := status(kmock_server)).get("stable") == v1 and s, E2E_WAIT, "the operator to follow"
        )
        assert back.get("canary") is None
        now = await traffic.survey()
        serving_v1 = {n for n, (made_for, got) in now.items() if made_for == got == v1}
        assert serving_v1, now
        assert serving_v1 <= v1_pods, (now, v1_pods)  # pods kept for the window since v2's promotion, not new ones
        assert (await agent_counters(socket)).bytes_downloaded == before
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{await diagnosis(kmock_server, cluster, operator, agent)}") from None
    finally:
        await traffic.close()
        if operator is not None:
            operator.stop()
        if agent is not None:
            await agent.close()
        cp.stop()
    assert not in_cluster.audit.denied, in_cluster.report()
    assert not in_cluster.audit.unused(NEEDED_ELSEWHERE), in_cluster.report()
