"""A process kubelet for kmock: the pods of a named node run as local processes.

kmock is an API server without controllers or nodes. Two small loops stand in for what runs
the pods in a cluster; both talk to kmock over HTTP only, as kube-controller-manager and a
kubelet talk to an API server (they poll the list every ``poll`` seconds instead of watching):

:class:`ReplicaSetController` (kube-controller-manager and the scheduler)
    keeps ``spec.replicas`` pods per live ReplicaSet: it creates them from the ReplicaSet's pod
    template, with an ``ownerReference`` to it (``controller: true``), named
    ``<replicaset>-<5 hex>`` and bound to a node at creation (``spec.nodeName``, the node with
    the fewest of that ReplicaSet's pods); it deletes the surplus when a ReplicaSet scales down
    (not-ready pods first, then the newest, as Kubernetes does) and the pods of a ReplicaSet that
    is gone (the garbage collector). It writes the ReplicaSet's ``status`` (``replicas``,
    ``readyReplicas``, ``availableReplicas``, ``observedGeneration``) from its pods' ``Ready``
    conditions.

:class:`Kubelet` (one per node)
    runs every pod bound to its node: each init container to completion, in order (a failed one
    is run again after a back-off, as with ``restartPolicy: Always``), then every container,
    restarted with a back-off when it exits. The image is ignored: a container is its
    ``command`` + ``args`` run as a local process, with its ``env`` (``value`` and the
    ``fieldRef`` fields a pod can read; ``$(VAR)`` references are expanded as Kubernetes does).
    Processes get a small base environment (``PATH`` with this interpreter's ``bin`` first,
    ``HOME`` in the pod's scratch directory) plus the kubelet's ``extra_env``, never the test's
    environment. It writes the pod's ``status``: ``phase``, the ``PodScheduled``,
    ``Initialized``, ``ContainersReady`` and ``Ready`` conditions, ``initContainerStatuses`` and
    ``containerStatuses`` (``state``, ``ready``, ``started``, ``restartCount``). When the pod is
    deleted, its processes get SIGTERM (SIGKILL after ``grace`` seconds).

There is no mount namespace, so a pod reaches its volumes by path rewriting:

- a ``hostPath`` volume is the directory ``<node root>/<path>`` (created for
  ``DirectoryOrCreate``): the node's "host" is a scratch directory, and a real agent process
  of that node keeps its data directory and its socket there (``Kubelet.host_path``);
- an ``emptyDir`` is a directory in the pod's scratch directory;
- every ``mountPath`` a container mounts is replaced by the volume's directory wherever it
  starts a path in the container's command, args and env values
  (``unix:/run/weightship/agent.sock`` becomes ``unix:<node root>/run/weightship/agent.sock``).

There is no network namespace either, so every pod gets its own loopback ports: each port a
container names (``ports[].containerPort``, and the readiness probe's ``httpGet.port``, by number
or by name) is given a free port of this machine; ``--port N`` and ``--port=N`` in the container's
command and args are rewritten to it, and the readiness probe is sent to it.
:meth:`Kubelet.endpoint` gives a test the URL of a pod's port. Probes run every
``periodSeconds``, but at most every ``probe_period`` seconds (tests do not wait 10 s); a pod is
ready once a probe succeeds and stops being ready after ``failureThreshold`` failures in a row.
Liveness and startup probes, resources, security contexts and Secret or ConfigMap references are
not acted on (a ``secretKeyRef`` env var stops the container with ``CreateContainerConfigError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from weightship.logs import event
from weightship.testing import free_port, terminate

__all__ = ["Cluster", "KubeClient", "Kubelet", "ReplicaSetController", "expand_vars", "map_paths", "map_ports", "pod_ready"]

_log = logging.getLogger("tests.kubernetes.kubelet")
Body = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_LABEL = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's ``Ready`` condition is ``True``."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _deleting(obj: Mapping[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


class KubeClient:
    """The few API calls the stand-ins make, over plain HTTP to kmock (no credentials: they are not under test)."""

    def __init__(self, server: str) -> None:
        self.server = server.rstrip("/")
        self._http: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        """The session (created on first use, on the running loop)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._http

    async def close(self) -> None:
        """Close the session."""
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def list(self, path: str) -> list[Body]:
        """The live items of a list path (``/api/v1/pods``: all namespaces)."""
        async with self.http.get(self.server + path) as answer:
            answer.raise_for_status()
            items: list[Body] = (await answer.json()).get("items") or []
        return [item for item in items if not _deleting(item)]

    async def create(self, path: str, body: Body) -> None:
        """POST ``body``; an error answer raises."""
        async with self.http.post(self.server + path, json=body) as answer:
            answer.raise_for_status()

    async def patch(self, path: str, body: Body) -> None:
        """A merge patch; a 404 (the object went meanwhile) is ignored."""
        async with self.http.patch(self.server + path, json=body, headers={"Content-Type": MERGE_PATCH}) as answer:
            if answer.status != 404:
                answer.raise_for_status()

    async def delete(self, path: str) -> None:
        """DELETE; gone already is fine."""
        async with self.http.delete(self.server + path) as answer:
            if answer.status != 404:
                answer.raise_for_status()


def _pod_path(pod: Mapping[str, Any], suffix: str = "") -> str:
    meta = pod["metadata"]
    return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}{suffix}"


class _Loop:
    """A polling loop on the running event loop, stopped by :meth:`stop`."""

    poll: float

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    async def step(self) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:  # kmock restarting, a write racing a delete
                event(_log, "kubelet.step_failed", logging.WARNING, loop=type(self).__name__, error=repr(exc))
            await asyncio.sleep(self.poll)  # ok-sleep: the resync period of a polling controller

    def start(self) -> None:
        """Start polling."""
        self._task = asyncio.create_task(self._run(), name=type(self).__name__)

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class ReplicaSetController(_Loop):
    """Materialises ReplicaSets as pods bound to ``nodes`` and reports their readiness (see the module docstring)."""

    def __init__(self, api: KubeClient, nodes: Sequence[str], *, poll: float = 0.05) -> None:
        super().__init__()
        self.api = api
        self.nodes = list(nodes)
        self.poll = poll

    async def stop(self) -> None:
        """Stop reconciling (the pods stay, as when the controller manager stops)."""
        await self._cancel()

    async def step(self) -> None:
        """One reconcile of every ReplicaSet."""
        replicasets = await self.api.list("/apis/apps/v1/replicasets")
        pods = await self.api.list("/api/v1/pods")
        live = {rs["metadata"]["uid"] for rs in replicasets}
        owned: dict[str, list[Body]] = {uid: [] for uid in live}
        for pod in pods:
            owner = next((o for o in pod["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
            if owner is None or owner.get("kind") != "ReplicaSet":
                continue
            if owner["uid"] in owned:
                owned[owner["uid"]].append(pod)
            else:  # its ReplicaSet is gone: the garbage collector deletes it
                await self.api.delete(_pod_path(pod))
        for rs in replicasets:
            await self._reconcile(rs, owned[rs["metadata"]["uid"]])

    async def _reconcile(self, rs: Body, pods: list[Body]) -> None:
        meta = rs["metadata"]
        wanted = int(rs["spec"].get("replicas", 1))
        for _ in range(wanted - len(pods)):
            pods.append(await self._create_pod(rs, pods))
        if len(pods) > wanted:
            # Not-ready first, then the newest (Kubernetes' own order, simplified).
            doomed = sorted(pods, key=lambda p: (pod_ready(p), p["metadata"].get("resourceVersion", "")))
            for pod in doomed[: len(pods) - wanted]:
                await self.api.delete(_pod_path(pod))
                pods.remove(pod)
        ready = sum(1 for pod in pods if pod_ready(pod))
        status = {
            "replicas": len(pods),
            "fullyLabeledReplicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": meta.get("generation", 1),
        }
        if {k: (rs.get("status") or {}).get(k) for k in status} != status:
            path = f"/apis/apps/v1/namespaces/{meta['namespace']}/replicasets/{meta['name']}/status"
            await self.api.patch(path, {"status": status})

    async def _create_pod(self, rs: Body, siblings: list[Body]) -> Body:
        meta, template = rs["metadata"], rs["spec"]["template"]
        load = {node: 0 for node in self.nodes}
        for sibling in siblings:
            node = sibling["spec"].get("nodeName")
            if node in load:
                load[node] += 1
        node = min(self.nodes, key=lambda n: load[n])
        pod: Body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{secrets.token_hex(3)[:5]}",
                "namespace": meta["namespace"],
                "labels": dict((template.get("metadata") or {}).get("labels") or {}),
                "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "ReplicaSet",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {**template["spec"], "nodeName": node},
            "status": {"phase": "Pending"},
        }
        await self.api.create(f"/api/v1/namespaces/{meta['namespace']}/pods", pod)
        event(_log, "replicaset.pod_created", pod=pod["metadata"]["name"], node=node)
        return pod


@dataclass
class _Container:
    """One container of a running pod: its spec, its process, what the kubelet reports of it."""

    spec: Body
    init: bool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    failures: int = 0
    exit_code: int | None = None
    waiting: str | None = "ContainerCreating"
    message: str = ""
    started_at: str = ""
    next_start: float = 0.0
    next_probe: float = 0.0

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def state(self) -> Body:
        if self.proc is not None and self.proc.poll() is None:
            return {"running": {"startedAt": self.started_at}}
        if self.exit_code is not None and (self.init or self.waiting is None):
            reason = "Completed" if self.exit_code == 0 else "Error"
            return {"terminated": {"exitCode": self.exit_code, "reason": reason}}
        return {"waiting": {"reason": self.waiting or "ContainerCreating", "message": self.message}}

    def status(self) -> Body:
        running = self.proc is not None and self.proc.poll() is None
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "ready": self.ready if not self.init else self.exit_code == 0,
            "started": running,
            "restartCount": self.restarts,
            "state": self.state(),
        }


@dataclass
class _PodRun:
    """The processes and the reported status of one pod."""

    pod: Body
    directory: Path
    ports: dict[int, int]
    init: list[_Container]
    main: list[_Container]
    reported: Body = field(default_factory=dict)
    error: str = ""

    @property
    def name(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"


class Kubelet(_Loop):
    """Runs the pods bound to ``node`` as local processes under ``root`` (see the module docstring)."""

    def __init__(
        self,
        api: KubeClient,
        node: str,
        root: Path,
        *,
        poll: float = 0.05,
        probe_period: float = 0.2,
        grace: float = 10.0,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.api = api
        self.node = node
        self.root = root
        self.poll = poll
        self.probe_period = probe_period
        self.grace = grace
        self.extra_env = dict(extra_env or {})
        self.runs: dict[str, _PodRun] = {}
        self._probes: aiohttp.ClientSession | None = None
        (root / "pods").mkdir(parents=True, exist_ok=True)

    # --- what tests ask ----------------------------------------------------------------------

    def host_path(self, path: str) -> Path:
        """Where this node's ``hostPath`` ``path`` lies (a real agent of this node uses the same directory)."""
        return self.root / path.lstrip("/")

    def endpoint(self, pod: str, port: int = 8000) -> str:
        """``http://127.0.0.1:<port>`` where pod ``pod`` (name, or namespace/name) listens on its ``port``."""
        run = self._run_named(pod)
        if port not in run.ports:
            raise KeyError(f"pod {run.name} declares no port {port}; it has {sorted(run.ports)}")
        return f"http://127.0.0.1:{run.ports[port]}"

    def log(self, pod: str, container: str | None = None) -> str:
        """What a container (default: the pod's first) of ``pod`` printed so far."""
        run = self._run_named(pod)
        name = container or run.main[0].name
        path = run.directory / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def running(self) -> list[str]:
        """``namespace/name`` of the pods this kubelet runs now."""
        return sorted(run.name for run in self.runs.values())

    def _run_named(self, pod: str) -> _PodRun:
        for run in self.runs.values():
            if pod in (run.name, run.pod["metadata"]["name"]):
                return run
        raise KeyError(f"node {self.node} runs no pod {pod!r}; it runs {self.running()}")

    # --- the loop ----------------------------------------------------------------------------

    async def register(self) -> None:
        """Create this node's Node object (a kubelet registers its node)."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node}},
            "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]},
        }
        with contextlib.suppress(aiohttp.ClientResponseError):  # 409: registered already
            await self.api.create("/api/v1/nodes", node)

    async def stop(self) -> None:
        """Stop every pod's processes and the loop; the pods' objects stay, as when a node goes down."""
        await self._cancel()
        for uid in list(self.runs):
            await self._stop_pod(uid)
        if self._probes is not None:
            await self._probes.close()

    async def step(self) -> None:
        """Start new pods of this node, stop gone ones, advance each pod, report changed statuses."""
        pods = {
            pod["metadata"]["uid"]: pod
            for pod in await self.api.list("/api/v1/pods")
            if pod.get("spec", {}).get("nodeName") == self.node
        }
        for uid in [uid for uid in self.runs if uid not in pods]:
            await self._stop_pod(uid)
        for uid, pod in pods.items():
            if uid not in self.runs:
                self.runs[uid] = self._admit(pod)
            run = self.runs[uid]
            run.pod = pod
            await self._advance(run)
            status = self._status(run)
            if status != run.reported:
                await self.api.patch(_pod_path(pod, "/status"), {"status": status})
                run.reported = status

    def _admit(self, pod: Body) -> _PodRun:
        meta = pod["metadata"]
        directory = self.root / "pods" / f"{meta['namespace']}_{meta['name']}"
        directory.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        containers = [*(spec.get("initContainers") or []), *spec["containers"]]
        named = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports") or [] if p.get("name")}
        wanted = {p["containerPort"] for c in containers for p in c.get("ports") or []}
        for c in containers:
            probe_port = ((c.get("readinessProbe") or {}).get("httpGet") or {}).get("port")
            if probe_port is not None:
                wanted.add(named.get(probe_port, probe_port))
        run = _PodRun(
            pod=pod,
            directory=directory,
            ports={int(p): free_port() for p in wanted},
            init=[_Container(c, init=True) for c in spec.get("initContainers") or []],
            main=[_Container(c, init=False) for c in spec["containers"]],
        )
        event(_log, "kubelet.pod_admitted", node=self.node, pod=run.name, ports=run.ports)
        return run

    async def _stop_pod(self, uid: str) -> None:
        run = self.runs[uid]
        procs = [c.proc for c in [*run.init, *run.main] if c.proc is not None]
        await asyncio.gather(*(asyncio.to_thread(terminate, p, self.grace) for p in procs))
        del self.runs[uid]  # only now: a pod listed as running has its processes
        event(_log, "kubelet.pod_stopped", node=self.node, pod=run.name)

    async def _advance(self, run: _PodRun) -> None:
        now = time.monotonic()
        for container in run.init:
            if container.exit_code == 0:
                continue
            self._supervise(run, container, now)
            return  # init containers run one at a time, in order
        for container in run.main:
            self._supervise(run, container, now)
        await asyncio.gather(*(self._probe(run, c, now) for c in run.main))

    def _supervise(self, run: _PodRun, container: _Container, now: float) -> None:
        """Start a container that is not running; note how a running one ended."""
        if container.proc is not None:
            code = container.proc.poll()
            if code is None:
                return
            container.exit_code = code
            container.proc = None
            container.ready = False
            if container.init and code == 0:
                return
            container.waiting = "CrashLoopBackOff"
            container.message = f"exited with {code}; see {run.directory / container.name}.log"
            container.next_start = now + min(5.0, 0.5 * 2**container.restarts)
            container.restarts += 1
            event(_log, "kubelet.container_exited", logging.WARNING, pod=run.name, container=container.name, code=code)
            return
        if now < container.next_start:
            return
        try:
            argv, env, cwd = self._command(run, container.spec)
        except (KeyError, ValueError) as exc:
            container.waiting, container.message = "CreateContainerConfigError", str(exc)
            return
        with open(run.directory / f"{container.name}.log", "ab") as log:
            try:
                container.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
            except OSError as exc:
                container.waiting, container.message = "RunContainerError", f"{argv[0]}: {exc}"
                container.next_start = now + 1.0
                return
        container.waiting, container.message, container.exit_code = None, "", None
        container.started_at, container.failures, container.next_probe = _now(), 0, now
        event(_log, "kubelet.container_started", pod=run.name, container=container.name, argv=" ".join(argv))

    async def _probe(self, run: _PodRun, container: _Container, now: float) -> None:
        if container.proc is None or container.proc.poll() is not None:
            container.ready = False
            return
        probe = container.spec.get("readinessProbe")
        if not probe:
            container.ready = True
            return
        if now < container.next_probe:
            return
        container.next_probe = now + min(float(probe.get("periodSeconds", 10)), self.probe_period)
        get = probe["httpGet"]
        named = {p["name"]: p["containerPort"] for p in container.spec.get("ports") or [] if p.get("name")}
        port = run.ports[int(named.get(get["port"], get["port"]))]
        if self._probes is None:
            self._probes = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        try:
            async with self._probes.get(f"http://127.0.0.1:{port}{get.get('path', '/')}") as answer:
                ok = 200 <= answer.status < 400
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok:
            container.ready, container.failures = True, 0
        else:
            container.failures += 1
            if container.failures >= int(probe.get("failureThreshold", 3)):
                container.ready = False

    # --- how a container becomes a process ---------------------------------------------------

    def _command(self, run: _PodRun, spec: Body) -> tuple[list[str], dict[str, str], str]:
        """argv, environment and working directory of a container, with its paths and ports mapped."""
        mounts = self._mounts(run, spec)
        env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(run.directory),
            "HOSTNAME": run.pod["metadata"]["name"],
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        for var in spec.get("env") or []:
            if "value" in var:
                value = expand_vars(str(var["value"]), env)
            elif "fieldRef" in (var.get("valueFrom") or {}):
                value = self._field(run.pod, var["valueFrom"]["fieldRef"]["fieldPath"])
            else:
                raise ValueError(f"env {var['name']}: only value and fieldRef are supported by this kubelet")
            env[var["name"]] = map_paths(value, mounts)
        argv = [expand_vars(str(a), env) for a in [*(spec.get("command") or []), *(spec.get("args") or [])]]
        if not argv:
            raise ValueError(f"container {spec['name']} has no command: this kubelet ignores images")
        argv = map_ports([map_paths(a, mounts) for a in argv], run.ports)
        cwd = map_paths(spec["workingDir"], mounts) if spec.get("workingDir") else str(run.directory)
        return argv, env, cwd

    def _mounts(self, run: _PodRun, spec: Body) -> list[tuple[str, str]]:
        """(mountPath, directory here) of each of the container's mounts, longest path first."""
        volumes = {v["name"]: v for v in run.pod["spec"].get("volumes") or []}
        mounts = []
        for mount in spec.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                directory = self.host_path(volume["hostPath"]["path"])
                if volume["hostPath"].get("type", "") in ("DirectoryOrCreate", "Directory", ""):
                    directory.mkdir(parents=True, exist_ok=True)
            elif "emptyDir" in volume:
                directory = run.directory / "volumes" / volume["name"]
                directory.mkdir(parents=True, exist_ok=True)
            else:
                raise ValueError(f"volume {volume['name']}: only hostPath and emptyDir are supported by this kubelet")
            if mount.get("subPath"):
                directory = directory / mount["subPath"]
            mounts.append((mount["mountPath"].rstrip("/") or "/", str(directory)))
        return sorted(mounts, key=lambda m: -len(m[0]))

    def _field(self, pod: Body, path: str) -> str:
        simple = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "metadata.uid": pod["metadata"].get("uid", ""),
            "spec.nodeName": self.node,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.hostIP": "127.0.0.1",
            "status.podIP": "127.0.0.1",
        }
        if path in simple:
            return str(simple[path])
        match = _FIELD_LABEL.fullmatch(path)
        if match:
            return str((pod["metadata"].get(match[1]) or {}).get(match[2], ""))
        raise ValueError(f"fieldRef {path} is not supported by this kubelet")

    def _status(self, run: _PodRun) -> Body:
        initialized = all(c.exit_code == 0 for c in run.init)
        started = initialized and all(c.proc is not None for c in run.main)
        ready = started and all(c.ready for c in run.main)

        def condition(kind: str, value: bool) -> Body:
            return {"type": kind, "status": "True" if value else "False"}

        return {
            "phase": "Running" if started else "Pending",
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "conditions": [
                condition("PodScheduled", True),
                condition("Initialized", initialized),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "initContainerStatuses": [c.status() for c in run.init],
            "containerStatuses": [c.status() for c in run.main],
        }


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a known variable is replaced, an unknown one kept, ``$$`` is ``$``."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _VAR.sub(one, text)


def map_paths(text: str, mounts: Sequence[tuple[str, str]]) -> str:
    """``text`` with each mount path that starts a path in it replaced by its directory here."""
    for mount_path, directory in mounts:
        pattern = re.compile(rf"(?<![\w./-]){re.escape(mount_path)}(?![\w.-])")
        text = pattern.sub(directory.replace("\\", "\\\\"), text)
    return text


def map_ports(argv: list[str], ports: Mapping[int, int]) -> list[str]:
    """``--port N`` / ``--port=N`` rewritten to the pod's port for ``N``."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--port=") and arg[7:].isdigit() and int(arg[7:]) in ports:
            out[i] = f"--port={ports[int(arg[7:])]}"
        elif arg == "--port" and i + 1 < len(out) and out[i + 1].isdigit() and int(out[i + 1]) in ports:
            out[i + 1] = str(ports[int(out[i + 1])])
    return out


class Cluster:
    """The stand-ins together: a ReplicaSet controller and a kubelet per node, against kmock at ``server``.

    ``async with Cluster(url, root, ["node-a"]) as cluster:`` registers the nodes and starts the
    loops; leaving stops every pod's processes first, then the loops.
    """

    def __init__(self, server: str, root: Path, nodes: Sequence[str], **kubelet: Any) -> None:
        self.api = KubeClient(server)
        self.controller = ReplicaSetController(self.api, nodes)
        self.kubelets = {node: Kubelet(self.api, node, root / node, **kubelet) for node in nodes}

    async def __aenter__(self) -> Cluster:
        for kubelet in self.kubelets.values():
            await kubelet.register()
            kubelet.start()
        self.controller.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.controller.stop()
        for kubelet in self.kubelets.values():
            await kubelet.stop()
        await self.api.close()

    def _owner(self, pod: str) -> Kubelet:
        for kubelet in self.kubelets.values():
            with contextlib.suppress(KeyError):
                kubelet._run_named(pod)
                return kubelet
        raise KeyError(f"no node runs pod {pod!r}")

    def endpoint(self, pod: str, port: int = 8000) -> str:
        """The URL of ``pod``'s ``port``, whichever node runs it."""
        return self._owner(pod).endpoint(pod, port)

    def log(self, pod: str, container: str | None = None) -> str:
        """What a container of ``pod`` printed so far."""
        return self._owner(pod).log(pod, container)

    async def pods(self, namespace: str) -> list[Body]:
        """The live pods of ``namespace`` as the API server has them."""
        return await self.api.list(f"/api/v1/namespaces/{namespace}/pods")
