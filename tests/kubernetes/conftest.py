"""Fixtures for the operator tests: kmock as the API server, a live control plane, real kopf operators.

- ``kmock`` — a :class:`VersionedEmulator` (kmock's Kubernetes emulator plus what the operator
  relies on from a real API server: ``resourceVersion`` on every write and 409 on a stale one);
  the resources the operator touches are registered for discovery.
- ``replicaset_controller`` — stands in for kube-controller-manager: marks every ReplicaSet's pods
  ready (``status.readyReplicas = spec.replicas``), as the kubelet does once the init container
  saw the version on the node.
- ``controlplane`` — the real control plane over HTTP (SQLite) with model ``chat`` (v1, v2,
  v3 seeded) and deployment ``chat-prod``; ``operator_token`` a real operator token.
- ``operators`` — starts real kopf operators (``controlplane.k8s.operator``) against kmock, each
  with its own identity; stops them all at the end.
- ``operator_processes`` — real ``python -m controlplane.k8s`` processes against kmock, for what
  only a separate process shows (``kill -9`` mid-rollout, then a fresh process).
- ``webhook`` — a real HTTP analysis hook whose answers a test sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from controlplane.k8s.operator import OperatorConfig, build_registry
from tests.controlplane.conftest import (  # noqa: F401  # fixtures re-exported for this suite
    LiveControlPlane,
    cp_settings,
    cp_state,
    live_controlplane,
    role_headers,
    seed_versions,
)
from weightship.testing import kill9, terminate

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = Path(__file__).parents[2] / "deploy" / "helm" / "weightship" / "crds" / "modelrollout.yaml"
ROLLOUTS = "weightship.io/v1alpha1/modelrollouts"
REPLICASETS = "apps/v1/replicasets"
NAMESPACE = "models"


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with optimistic concurrency: ``resourceVersion`` bumps, stale writes get 409.

    ``foreign_writes[(plural, name)] = n`` makes the next ``n`` writes to that object meet a change
    by another writer first (an annotation bump), so the operator's write carries a stale
    ``resourceVersion`` and gets the 409 a real API server would answer. ``authorize``, when set,
    refuses requests before they are served (RBAC, see ``rbac.py``).
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.counter = itertools.count(1)
        self.foreign_writes: dict[tuple[str, str], int] = {}
        self.conflicts = 0
        #: checks each request before it is served, raising ``kmock.KubernetesError`` (401, 403) to
        #: refuse it, as an API server's authentication and authorization do (``rbac.Audit.enforce``)
        self.authorize: Callable[[Any], None] | None = None

    async def _handle(self, request: Any) -> Any:
        if self.authorize is not None:
            self.authorize(request)
        action = request.action
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):  # kopf's events are named by the server
                    meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:8]}"
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = str(next(self.counter))
            elif action == kmock.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                current = self.objects[key] if key in self.objects else None  # noqa: SIM401  # kmock has no .get for object keys
                if current is not None and not current.deleted:
                    pending = self.foreign_writes.get((request.resource.plural, request.name), 0)
                    if pending:
                        self.foreign_writes[(request.resource.plural, request.name)] = pending - 1
                        current.patch({"metadata": {"annotations": {"other-writer": str(pending)},
                                                    "resourceVersion": str(next(self.counter))}})  # fmt: skip
                    sent = meta.get("resourceVersion")
                    if sent is not None and sent != current.get("metadata", {}).get("resourceVersion"):
                        self.conflicts += 1
                        raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
                meta["resourceVersion"] = str(next(self.counter))
        return await super()._handle(request)


def crd() -> dict[str, Any]:
    """The ModelRollout CRD as shipped in the chart."""
    data: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
    return data


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: the operator's behaviour does not depend on the control plane's database."""
    return f"sqlite:///{tmp_path / 'cp.db'}"


@pytest_asyncio.fixture
async def kmock_server() -> AsyncIterator[VersionedEmulator]:
    """The mock API server with the operator's resources registered."""
    async with VersionedEmulator() as handler, kmock.Server(handler):
        handler.resources[ROLLOUTS] = kmock.ResourceInfo(
            kind="ModelRollout", singular="modelrollout", shortnames={"mro"},
            verbs={"get", "list", "watch", "patch", "create", "delete"}, subresources={"status"},
            namespaced=True,
        )  # fmt: skip
        for resource, kind in ((REPLICASETS, "ReplicaSet"), ("coordination.k8s.io/v1/leases", "Lease"),
                               ("v1/events", "Event"), ("v1/services", "Service")):  # fmt: skip
            handler.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=True,
                                                             verbs={"get", "list", "watch", "patch", "create", "delete"})  # fmt: skip
        # What the process kubelet (tests/kubernetes/kubelet.py) reads and writes.
        handler.resources["v1/pods"] = kmock.ResourceInfo(
            kind="Pod", namespaced=True, subresources={"status"},
            verbs={"get", "list", "watch", "patch", "create", "delete"},
        )  # fmt: skip
        handler.resources["v1/nodes"] = kmock.ResourceInfo(kind="Node", namespaced=False,
                                                           verbs={"get", "list", "watch", "create"})  # fmt: skip
        # kopf's namespace and CRD observers wait for these to be discoverable.
        for resource, kind in (("v1/namespaces", "Namespace"),
                               ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition")):  # fmt: skip
            handler.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=False, verbs={"get", "list", "watch"})
        yield handler


@pytest_asyncio.fixture
async def replicaset_controller(kmock_server: VersionedEmulator) -> AsyncIterator[None]:
    """Marks ReplicaSets' pods ready, as Kubernetes would (polling, 20 ms)."""

    async def loop() -> None:
        while True:
            for key in list(kmock_server.objects):
                if key[0] != kmock.resource(REPLICASETS):
                    continue
                obj = kmock_server.objects[key]
                if obj.deleted:
                    continue
                wanted = obj.get("spec", {}).get("replicas", 0)
                if obj.get("status", {}).get("readyReplicas") != wanted:
                    obj.patch({"status": {"replicas": wanted, "readyReplicas": wanted}})
            await asyncio.sleep(0.02)  # ok-sleep: the stand-in controller's resync period

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture
def operator_token(role_headers: dict[Any, dict[str, str]]) -> str:
    """A real operator-role token of the live control plane."""
    from weightship.schemas import Role

    return role_headers[Role.operator]["Authorization"].removeprefix("Bearer ")


@pytest.fixture
def controlplane(
    live_controlplane: LiveControlPlane, seed_versions: Callable[..., dict[str, str]], operator_token: str
) -> tuple[str, dict[str, str]]:
    """(url, {label: digest}) of a live control plane with model chat and deployment chat-prod."""
    from weightship.client import Client

    digests = seed_versions("chat")
    admin = {"Authorization": "Bearer ws_test-bootstrap-admin-0123456789abcdef"}
    with Client(live_controlplane.url, admin["Authorization"].removeprefix("Bearer ")) as client:
        client.create_deployment("chat-prod", "chat")
    return live_controlplane.url, digests


class Operators:
    """Real kopf operators against kmock, started and stopped by tests, each on its own thread and loop.

    A kopf operator that stops waits for, then cancels, every task started in its loop after it
    began; on a loop of its own those are its own tasks only, not the test's or kmock's (on the
    test's loop it waited 5 s on them at every stop). Several replicas as processes are
    ``operator_processes``.
    """

    def __init__(self, server: VersionedEmulator, cp_url: str, token: str) -> None:
        self.server = server
        self.cp_url = cp_url
        self.token = token
        self.running: dict[str, tuple[threading.Thread, threading.Event, Any]] = {}

    def start(self, identity: str, *, lease_seconds: float = 1.5) -> Any:
        """Start an operator named ``identity``; returns its leader handle."""
        import kopf

        config = OperatorConfig(
            controlplane_url=self.cp_url, token=self.token, kube_server=str(self.server.url).rstrip("/"),
            identity=identity, lease_namespace=NAMESPACE, lease_seconds=lease_seconds, interval=0.2,
        )  # fmt: skip
        registry, leader = build_registry(config)
        stop = threading.Event()

        def run() -> None:
            asyncio.run(kopf.operator(registry=registry, standalone=True, clusterwide=True, stop_flag=stop))

        thread = threading.Thread(target=run, name=f"operator-{identity}", daemon=True)
        thread.start()
        self.running[identity] = (thread, stop, leader)
        return leader

    async def stop(self, identity: str) -> None:
        """Stop one operator gracefully (its cleanup runs)."""
        thread, stop, _ = self.running.pop(identity)
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive(), f"operator {identity} did not stop within 20 s"


@pytest_asyncio.fixture
async def operators(
    kmock_server: VersionedEmulator, controlplane: tuple[str, dict[str, str]], operator_token: str
) -> AsyncIterator[Operators]:
    """Start operators with ``operators.start(identity)``; all stop at the end."""
    ops = Operators(kmock_server, controlplane[0], operator_token)
    yield ops
    for identity in list(ops.running):
        await ops.stop(identity)


class OperatorProcess:
    """One real operator process (``python -m controlplane.k8s``), configured as the chart does: by environment."""

    def __init__(self, server: VersionedEmulator, cp_url: str, token: str, identity: str, log_path: Path) -> None:
        self.identity = identity
        self.log_path = log_path
        self.env = {
            **os.environ,
            "WEIGHTSHIP_URL": cp_url,
            "WEIGHTSHIP_TOKEN": token,
            "WEIGHTSHIP_OPERATOR_KUBE_SERVER": str(server.url).rstrip("/"),
            "WEIGHTSHIP_OPERATOR_IDENTITY": identity,
            "WEIGHTSHIP_OPERATOR_LEASE_NAMESPACE": NAMESPACE,
            "WEIGHTSHIP_OPERATOR_LEASE_SECONDS": "1.5",
            "WEIGHTSHIP_OPERATOR_INTERVAL": "0.2",
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Launch it; its output goes to ``log_path``."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controlplane.k8s"], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def kill9(self) -> None:
        """SIGKILL: no clean-up, no lease released, whatever was in flight is lost."""
        assert self.proc is not None
        kill9(self.proc)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 10 s)."""
        terminate(self.proc)

    def log(self) -> str:
        """What the process printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def operator_processes(
    kmock_server: VersionedEmulator, controlplane: tuple[str, dict[str, str]], operator_token: str, tmp_path: Path
) -> Iterator[Callable[[str], OperatorProcess]]:
    """``spawn(identity)`` starts an operator process; all are stopped at the end."""
    spawned: list[OperatorProcess] = []

    def spawn(identity: str) -> OperatorProcess:
        process = OperatorProcess(kmock_server, controlplane[0], operator_token, identity, tmp_path / f"{identity}.log")
        process.start()
        spawned.append(process)
        return process

    yield spawn
    for process in spawned:
        process.stop()


class Webhook:
    """A real HTTP analysis hook; ``answers`` is popped front to back, the last one repeats."""

    def __init__(self) -> None:
        self.answers: list[Any] = [{"value": 0.001}]
        self.calls: list[dict[str, Any]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(await request.json())
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return web.json_response(answer)


@pytest_asyncio.fixture
async def webhook() -> AsyncIterator[Webhook]:
    """The hook, listening on a loopback port."""
    hook = Webhook()
    app = web.Application()
    app.router.add_post("/judge", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hook.url = f"http://127.0.0.1:{port}/judge"
    yield hook
    await runner.cleanup()


# Imported last: the module imports this conftest.
from tests.kubernetes.rbac_parts import in_cluster as in_cluster  # noqa: E402 - a fixture for every test below this folder
