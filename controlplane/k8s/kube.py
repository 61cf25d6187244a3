"""The Kubernetes API as the operator uses it, through the official ``kubernetes`` client.

Objects travel as plain dicts (``_preload_content=False``), so nothing is lost to the client's
models and the code reads like the manifests. The client is synchronous; every call runs in a
worker thread. Errors are mapped at this boundary, so callers catch ours, never the client's:

- HTTP 409 (someone else wrote the object since we read it: ``metadata.resourceVersion``
  mismatched, or it already exists) → :class:`weightship.errors.ConflictError` — re-read and retry;
- HTTP 404 → :class:`weightship.errors.NotFoundError`;
- anything else (403 forbidden by RBAC, 422 refused by validation or admission...), and
  connection failures → :class:`KubeApiError`, a :class:`weightship.errors.TemporaryError` that
  keeps the HTTP status and the API server's reason, so the driver can say on the ModelRollout
  (a condition and an Event) what the API server refused, not only in the log.

Writes that must not overwrite a concurrent change carry the ``resourceVersion`` they were
computed from (optimistic concurrency, as ``kubectl`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client as k8s
import kubernetes.config as k8s_config
import kubernetes.config.incluster_config as k8s_incluster
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from controlplane.k8s.rollout import GROUP, LABEL_ROLLOUT, PLURAL, VERSION
from weightship.errors import ConflictError, NotFoundError, TemporaryError, WeightshipError

__all__ = ["SERVICE_ACCOUNT_DIR", "InCluster", "KubeApi", "KubeApiError", "connect"]

_T = TypeVar("_T")
Body = dict[str, Any]


class KubeApiError(TemporaryError):
    """The Kubernetes API refused a request (``status``: 403, 422...) or could not be reached (``status`` 0).

    ``reason`` is the API server's own word for it (``Forbidden``, ``Invalid``...), or
    ``Unreachable``. Retried on the next reconcile: RBAC or an admission policy may be fixed meanwhile.
    """

    def __init__(self, message: str, *, status: int, reason: str) -> None:
        super().__init__(message, delay=2.0)
        self.status = status
        self.reason = reason


#: Where Kubernetes mounts a pod's ServiceAccount token, CA and namespace;
#: ``WEIGHTSHIP_KUBE_SERVICE_ACCOUNT_DIR`` names another directory (tests run in-cluster configuration
#: against kmock over TLS).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class InCluster:
    """The API server (``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``) and a pod's mounted credentials."""

    server: str
    token_path: Path
    ca_path: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InCluster | None:
        """The in-cluster configuration, or None outside a pod (no service host, or no token file)."""
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        directory = Path(env.get("WEIGHTSHIP_KUBE_SERVICE_ACCOUNT_DIR") or SERVICE_ACCOUNT_DIR)
        if not host or not port or not (directory / "token").is_file():
            return None
        bracketed = f"[{host}]" if ":" in host else host
        return cls(f"https://{bracketed}:{port}", directory / "token", directory / "ca.crt")

    def token(self) -> str:
        """The token as mounted now (the kubelet rotates the file; read it at each login)."""
        return self.token_path.read_text(encoding="utf-8").strip()


def connect(server: str | None = None, *, user_agent: str = "weightship-operator") -> KubeApi:
    """A client for ``server`` (plain URL, tests), else in-cluster credentials, else the kubeconfig."""
    configuration = k8s.Configuration()
    in_cluster = None if server else InCluster.from_env()
    if server:
        configuration.host = server.rstrip("/")
    elif in_cluster is not None:
        k8s_incluster.InClusterConfigLoader(
            token_filename=str(in_cluster.token_path), cert_filename=str(in_cluster.ca_path)
        ).load_and_set(configuration)
    else:
        k8s_config.load_kube_config(client_configuration=configuration)
    api = k8s.ApiClient(configuration)
    api.user_agent = user_agent
    return KubeApi(api)


class KubeApi:
    """Typed-by-purpose access to the few resources the operator touches."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.api = api
        self._core = k8s.CoreV1Api(api)
        self._apps = k8s.AppsV1Api(api)
        self._custom = k8s.CustomObjectsApi(api)
        self._coordination = k8s.CoordinationV1Api(api)

    def close(self) -> None:
        """Release the connection pool."""
        self.api.close()

    async def _call(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Body:
        def run() -> Body:
            try:
                answer = call(*args, _preload_content=False, **kwargs)
            except ApiException as exc:
                raise _mapped(exc, what) from None
            except (HTTPError, OSError) as exc:
                raise KubeApiError(
                    f"{what}: the Kubernetes API is unreachable ({exc}); check the API server and the network",
                    status=0,
                    reason="Unreachable",
                ) from None
            data = answer.data
            return json.loads(data) if data else {}

        return await asyncio.to_thread(run)

    # --- ModelRollouts ------------------------------------------------------------------------

    async def get_rollout(self, namespace: str, name: str) -> Body:
        """The ModelRollout as stored now."""
        return await self._call(
            f"read ModelRollout {namespace}/{name}",
            self._custom.get_namespaced_custom_object,
            GROUP, VERSION, namespace, PLURAL, name,
        )  # fmt: skip

    async def patch_rollout_status(self, namespace: str, name: str, status: Body, resource_version: str | None) -> Body:
        """Merge ``status`` into the rollout's status; 409 if it changed since ``resource_version``."""
        metadata = {"resourceVersion": resource_version} if resource_version else {}
        return await self._call(
            f"write the status of ModelRollout {namespace}/{name}",
            self._custom.patch_namespaced_custom_object_status,
            GROUP, VERSION, namespace, PLURAL, name, {"metadata": metadata, "status": status},
        )  # fmt: skip

    # --- ReplicaSets --------------------------------------------------------------------------

    async def list_replicasets(self, namespace: str, rollout: str) -> list[Body]:
        """The rollout's ReplicaSets (by label; filtered here too, in case the server ignores selectors)."""
        answer = await self._call(
            f"list the ReplicaSets of ModelRollout {namespace}/{rollout}",
            self._apps.list_namespaced_replica_set,
            namespace,
            label_selector=f"{LABEL_ROLLOUT}={rollout}",
        )
        items: list[Body] = answer.get("items") or []
        return [rs for rs in items if (rs.get("metadata", {}).get("labels") or {}).get(LABEL_ROLLOUT) == rollout]

    async def create_replicaset(self, namespace: str, body: Body) -> Body:
        """Create a ReplicaSet; 409 (ConflictError) if one of that name exists."""
        name = body["metadata"]["name"]
        return await self._call(
            f"create ReplicaSet {namespace}/{name}", self._apps.create_namespaced_replica_set, namespace, body
        )

    async def patch_replicaset(self, namespace: str, name: str, patch: Body) -> Body:
        """Merge ``patch`` into a ReplicaSet (labels, replicas)."""
        return await self._call(
            f"update ReplicaSet {namespace}/{name}", self._apps.patch_namespaced_replica_set, name, namespace, patch
        )

    async def delete_replicaset(self, namespace: str, name: str) -> None:
        """Delete a ReplicaSet (its pods go with it); gone already is fine."""
        with contextlib.suppress(NotFoundError):
            await self._call(
                f"delete ReplicaSet {namespace}/{name}", self._apps.delete_namespaced_replica_set, name, namespace
            )

    # --- traffic routers ----------------------------------------------------------------------

    async def patch_service(self, namespace: str, name: str, patch: Body) -> Body:
        """Merge ``patch`` into a Service (its selector)."""
        return await self._call(
            f"update Service {namespace}/{name}", self._core.patch_namespaced_service, name, namespace, patch
        )

    async def get_http_route(self, namespace: str, name: str) -> Body:
        """A Gateway API HTTPRoute."""
        return await self._call(
            f"read HTTPRoute {namespace}/{name}",
            self._custom.get_namespaced_custom_object,
            "gateway.networking.k8s.io", "v1", namespace, "httproutes", name,
        )  # fmt: skip

    async def patch_http_route(self, namespace: str, name: str, patch: Body) -> Body:
        """Merge ``patch`` into an HTTPRoute (its rules' backend weights; 409 if it changed meanwhile)."""
        return await self._call(
            f"update HTTPRoute {namespace}/{name}",
            self._custom.patch_namespaced_custom_object,
            "gateway.networking.k8s.io", "v1", namespace, "httproutes", name, patch,
        )  # fmt: skip

    # --- leases -------------------------------------------------------------------------------

    async def get_lease(self, namespace: str, name: str) -> Body:
        """A coordination.k8s.io/v1 Lease."""
        return await self._call(
            f"read Lease {namespace}/{name}", self._coordination.read_namespaced_lease, name, namespace
        )

    async def create_lease(self, namespace: str, body: Body) -> Body:
        """Create a Lease; 409 if another replica created it first."""
        return await self._call(
            f"create Lease {namespace}/{body['metadata']['name']}",
            self._coordination.create_namespaced_lease,
            namespace,
            body,
        )

    async def patch_lease(self, namespace: str, name: str, patch: Body) -> Body:
        """Merge ``patch`` into a Lease; 409 if it changed since the ``resourceVersion`` in ``patch``."""
        return await self._call(
            f"update Lease {namespace}/{name}", self._coordination.patch_namespaced_lease, name, namespace, patch
        )


def _mapped(exc: ApiException, what: str) -> WeightshipError:
    reason = _reason(exc)
    if exc.status == 409:
        return ConflictError(f"{what}: conflict ({reason}); re-read the object and retry")
    if exc.status == 404:
        return NotFoundError(f"{what}: not found ({reason})")
    advice = {
        403: "grant it in the operator's Role (the chart's templates/operator.yaml)",
        422: "an admission policy or the object's schema refused it; see the message",
    }.get(int(exc.status or 0), "retrying")
    return KubeApiError(
        f"{what}: the Kubernetes API answered HTTP {exc.status} ({reason}); {advice}",
        status=int(exc.status or 0),
        reason=_status_reason(exc),
    )


def _body(exc: ApiException) -> Mapping[str, Any]:
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _reason(exc: ApiException) -> str:
    body = _body(exc)
    return str(body.get("message") or body.get("reason") or exc.reason)


def _status_reason(exc: ApiException) -> str:
    """The API server's one-word reason (a ``Status`` object's ``reason``), else the HTTP reason phrase."""
    reason = str(_body(exc).get("reason") or exc.reason or f"HTTP{exc.status}")
    return "".join(reason.title().split()) if " " in reason else reason
