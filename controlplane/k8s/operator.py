"""The kopf wiring: one registry per operator instance, handlers bound to one driver and one elector.

:func:`build_registry` returns a fresh ``kopf.OperatorRegistry`` (never kopf's global one), so a
process (or a test) can run several operators side by side. Handlers:

- ``login`` — the API server named in the config (tests: kmock's URL), else kopf's usual login
  (in-cluster service account, then the kubeconfig);
- ``startup`` / ``cleanup`` — open the Kubernetes and control-plane clients and the analysis
  providers; start and stop leader election;
- ``on.event`` for ModelRollouts: one worker per object (``workers.py``) reconciles it every
  ``interval`` seconds and at once when its spec or annotations change; the leader reconciles,
  followers do nothing. The engine is level-triggered, so ticks are all it needs: a missed tick
  only delays, and a restarted operator resumes from the resource's status. No handler needs a
  finalizer, so deleting a ModelRollout, its namespace or the release never waits on the
  operator (``workers.py`` says why kopf's timers are not used).

A reconcile that fails (the Kubernetes API refused a request, the control plane cannot be
reached) becomes the ``Reconciled=False`` condition and a Warning Event on the ModelRollout
(``KubeRolloutDriver.report_failure``), not only a log line; the worker tries again on the next tick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from controlplane.k8s.analysis import RemoteBuiltinProvider
from controlplane.k8s.driver import KubeRolloutDriver
from controlplane.k8s.kube import Body, InCluster, KubeApi, connect
from controlplane.k8s.leader import LeaderElector
from controlplane.k8s.replicasets import DEFAULT_WAIT_IMAGE, AgentPaths
from controlplane.k8s.rollout import GROUP, PLURAL, VERSION
from controlplane.k8s.versions import ControlPlane
from controlplane.k8s.workers import Workers
from controlplane.rollouts.providers import ProviderRegistry
from weightship.backoff import Backoff
from weightship.client import Client
from weightship.errors import WeightshipError
from weightship.logs import event

__all__ = ["OperatorConfig", "build_registry", "run"]

_log = logging.getLogger("controlplane.k8s.operator")


@dataclass(frozen=True)
class OperatorConfig:
    """Everything an operator instance needs; ``from_env`` reads the ``WEIGHTSHIP_OPERATOR_*`` variables."""

    controlplane_url: str
    token: str | None
    kube_server: str | None = None
    namespaces: tuple[str, ...] = ()
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    lease_namespace: str = "default"
    lease_name: str = "weightship-operator"
    lease_seconds: float = 15.0
    interval: float = 2.0
    wait_image: str = DEFAULT_WAIT_IMAGE
    #: how long each pod's waiter holds it for its version before giving up (None: the waiter's default)
    wait_deadline: float | None = None
    agent_paths: AgentPaths = field(default_factory=AgentPaths)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorConfig:
        """Read the configuration from the environment (the chart sets these)."""
        env = dict(os.environ if environ is None else environ)
        namespaces = tuple(n for n in env.get("WEIGHTSHIP_OPERATOR_NAMESPACES", "").split(",") if n.strip())
        defaults = cls(controlplane_url="", token=None)
        return cls(
            controlplane_url=env.get("WEIGHTSHIP_URL") or "http://127.0.0.1:8080",
            token=env.get("WEIGHTSHIP_TOKEN") or None,
            kube_server=env.get("WEIGHTSHIP_OPERATOR_KUBE_SERVER") or None,
            namespaces=namespaces,
            identity=env.get("WEIGHTSHIP_OPERATOR_IDENTITY") or env.get("POD_NAME") or defaults.identity,
            lease_namespace=env.get("WEIGHTSHIP_OPERATOR_LEASE_NAMESPACE") or env.get("POD_NAMESPACE") or "default",
            lease_name=env.get("WEIGHTSHIP_OPERATOR_LEASE_NAME") or defaults.lease_name,
            lease_seconds=float(env.get("WEIGHTSHIP_OPERATOR_LEASE_SECONDS") or defaults.lease_seconds),
            interval=float(env.get("WEIGHTSHIP_OPERATOR_INTERVAL") or defaults.interval),
            wait_image=env.get("WEIGHTSHIP_OPERATOR_WAIT_IMAGE") or defaults.wait_image,
            wait_deadline=float(env["WEIGHTSHIP_OPERATOR_WAIT_DEADLINE"]) if env.get("WEIGHTSHIP_OPERATOR_WAIT_DEADLINE") else None,
            agent_paths=AgentPaths(
                data_dir=env.get("WEIGHTSHIP_AGENT_HOST_DATA_DIR") or defaults.agent_paths.data_dir,
                socket_dir=env.get("WEIGHTSHIP_AGENT_SOCKET_DIR") or defaults.agent_paths.socket_dir,
            ),
        )


@dataclass
class _Runtime:
    driver: KubeRolloutDriver | None = None
    elector: LeaderElector | None = None
    kube: KubeApi | None = None
    client: Client | None = None
    providers: ProviderRegistry | None = None
    workers: Workers | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _post_event(body: Body, kind: str, reason: str, message: str) -> None:
    kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=kind, reason=reason, message=message[:1000])


def build_registry(config: OperatorConfig) -> tuple[kopf.OperatorRegistry, LeaderElectorRef]:
    """A fresh registry with this operator's handlers, and a handle to its elector (for status and tests)."""
    registry = kopf.OperatorRegistry()
    runtime = _Runtime()
    ref = LeaderElectorRef(runtime)

    async def reconcile(namespace: str, name: str) -> None:
        if runtime.driver is None or runtime.elector is None or not runtime.elector.is_leader:
            return  # a follower: the leader acts
        try:
            await runtime.driver.reconcile(namespace, name)
        except WeightshipError as exc:
            event(_log, "rollout.retry_later", logging.WARNING, rollout=f"{namespace}/{name}", error=exc.message)
            await runtime.driver.report_failure(namespace, name, exc)
        except Exception as exc:  # a bug must not stop this rollout's worker for good
            event(_log, "rollout.reconcile_crashed", logging.ERROR, rollout=f"{namespace}/{name}", error=repr(exc))
            await runtime.driver.report_failure(namespace, name, exc)

    runtime.workers = Workers(reconcile, config.interval)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if config.kube_server:
            return kopf.ConnectionInfo(server=config.kube_server)
        in_cluster = InCluster.from_env()
        if in_cluster is not None:  # the pod's ServiceAccount, wherever it is mounted
            return kopf.ConnectionInfo(
                server=in_cluster.server, ca_path=str(in_cluster.ca_path), scheme="Bearer", token=in_cluster.token()
            )
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 60
        runtime.kube = connect(config.kube_server, user_agent=f"weightship-operator/{config.identity}")
        # Two tries per call: a reconcile that fails is retried on the next tick anyway, and the
        # pods converge meanwhile (a longer retry here would hold them up).
        runtime.client = Client(config.controlplane_url, config.token, backoff=Backoff(attempts=2))
        runtime.providers = ProviderRegistry.default(builtin=RemoteBuiltinProvider(runtime.client))
        runtime.driver = KubeRolloutDriver(
            runtime.kube, ControlPlane(runtime.client), runtime.providers,
            post_event=_post_event, wait_image=config.wait_image, agent_paths=config.agent_paths,
            wait_deadline=config.wait_deadline,
        )  # fmt: skip
        runtime.elector = LeaderElector(
            runtime.kube, config.lease_namespace, config.lease_name, config.identity, lease_seconds=config.lease_seconds
        )
        runtime.tasks.append(asyncio.create_task(runtime.elector.run(), name="leader-election"))
        event(_log, "operator.started", identity=config.identity, namespaces=",".join(config.namespaces) or "*")

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if runtime.workers is not None:
            await runtime.workers.stop_all()
        for task in runtime.tasks:
            task.cancel()
        await asyncio.gather(*runtime.tasks, return_exceptions=True)
        if runtime.providers is not None:
            await runtime.providers.aclose()
        if runtime.client is not None:
            runtime.client.close()
        if runtime.kube is not None:
            runtime.kube.close()
        event(_log, "operator.stopped", identity=config.identity)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def seen(
        type: str | None, name: str | None, namespace: str | None, body: kopf.Body, **_: Any
    ) -> None:  # kopf passes the event type as ``type``
        if name is None or namespace is None or runtime.workers is None:
            return
        runtime.workers.seen(namespace, name, cast(dict[str, Any], dict(body)), gone=type == "DELETED")

    return registry, ref


@dataclass
class LeaderElectorRef:
    """Whether this operator instance leads right now (the elector exists only once started)."""

    runtime: _Runtime

    @property
    def is_leader(self) -> bool:
        """True while this instance holds the Lease."""
        return self.runtime.elector is not None and self.runtime.elector.is_leader


async def run(config: OperatorConfig, *, stop_flag: asyncio.Event | None = None) -> None:
    """Run one operator until ``stop_flag`` is set (or forever)."""
    registry, _ = build_registry(config)
    await kopf.operator(
        registry=registry,
        standalone=True,
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        stop_flag=stop_flag,
        # kopf's own liveness endpoint (GET /healthz), e.g. http://0.0.0.0:8081/healthz: the chart's probes.
        liveness_endpoint=os.environ.get("WEIGHTSHIP_OPERATOR_LIVENESS") or None,
    )
