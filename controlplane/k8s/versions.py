"""What the operator asks the control plane: which digest a label names, and keeping agents in step.

The ``ModelRollout`` names a label (``v7``) or a digest; the control plane's REST API (the
``weightship.client.Client``, with an operator token) resolves it against the deployment's model,
so an unknown label or digest is refused before any pod is created. The deployment's serving
pointer is also kept in step with the ReplicaSets (stable, and the canary at share 0): agents
keep and pre-fetch exactly the versions a pointer names, so the canary's bytes are staged on every
node before its pods are scheduled (the engine's prefetch step counts the nodes that hold it).
The operator reads the pointer back on every reconcile, and the newest audit row when it changed,
so a move made outside the rollout (``weightship rollback``) is seen and followed; it asks
which labels a digest has, so ``kubectl get mro`` shows ``v2`` rather than a digest; and it asks
how the nodes' model servers fared loading the canary (``GET /v1/deployments/{name}/analysis/loads``,
from the counters they push to their agent), so a canary its pods refuse is rolled back at once.
The client is synchronous; calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from weightship.client import Client
from weightship.errors import NotFoundError, PreconditionFailed
from weightship.schemas import Deployment, PointerEvent

__all__ = ["ControlPlane", "FleetCount", "NodeLoad", "ResolvedVersion", "UnknownVersion"]


class UnknownVersion(NotFoundError):
    """The rollout names a version (or deployment) the control plane does not know."""


@dataclass(frozen=True)
class ResolvedVersion:
    """A label or digest resolved to the digest and size of a ready version."""

    digest: str
    size: int
    model: str


@dataclass(frozen=True)
class FleetCount:
    """How many of the deployment's nodes hold ``digest`` verified, and why others cannot."""

    target_nodes: int
    staged_nodes: int
    failures: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeLoad:
    """How a node's model servers fared loading one version: loaded once, and failed loads so far (cumulative)."""

    loaded: bool
    failures: int


class ControlPlane:
    """The control plane's REST API as the operator uses it."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def resolve(self, deployment: str, ref: str) -> ResolvedVersion:
        """The digest ``ref`` names for ``deployment``'s model; :class:`UnknownVersion` if there is none."""

        def run() -> ResolvedVersion:
            try:
                model = self.client.get_deployment(deployment).model
            except NotFoundError:
                raise UnknownVersion(
                    f"deployment {deployment!r} does not exist in the control plane; create it with "
                    f"'weightship deployment create {deployment} --model MODEL' or fix spec.deployment"
                ) from None
            try:
                info = self.client.get_version(model, ref)
            except NotFoundError:
                raise UnknownVersion(
                    f"version {ref!r} of model {model!r} (deployment {deployment!r}) is unknown to the control "
                    f"plane; publish it or fix spec.version ('weightship versions {model}' lists them)"
                ) from None
            if info.state != "ready":
                raise UnknownVersion(
                    f"version {ref!r} of model {model!r} is {info.state}, not ready; wait for its publish to commit"
                )
            return ResolvedVersion(info.digest, info.size, model)

        return await asyncio.to_thread(run)

    async def pointer(self, deployment: str) -> Deployment:
        """The deployment's serving pointer as the control plane holds it now."""
        return await asyncio.to_thread(self.client.get_deployment, deployment)

    async def last_change(self, deployment: str) -> PointerEvent | None:
        """The newest audit row of the deployment's pointer (who moved it, how, why), if any."""
        rows = await asyncio.to_thread(self.client.history, deployment, limit=1)
        return rows[0] if rows else None

    async def label_of(self, model: str, digest: str) -> str | None:
        """A label of ``digest`` (the first one set), or None when it has none."""
        info = await asyncio.to_thread(self.client.get_version, model, digest)
        return info.labels[0] if info.labels else None

    async def sync_pointer(self, deployment: str, stable: str, canary: str | None, reason: str) -> None:
        """Point ``deployment`` at ``stable`` with ``canary`` staged (share 0) unless it already is."""

        def run() -> None:
            for _ in range(3):
                pointer = self.client.get_deployment(deployment)
                if pointer.stable == stable and pointer.canary == canary and pointer.canary_share == 0:
                    return
                try:
                    self.client.set_pointer(
                        deployment, stable, canary=canary, canary_share=0.0, reason=reason, expected_epoch=pointer.epoch
                    )
                    return
                except PreconditionFailed:
                    continue  # someone moved it meanwhile: re-read and retry

        await asyncio.to_thread(run)

    async def fleet(self, deployment: str, digest: str) -> FleetCount:
        """Nodes of ``deployment`` and how many hold ``digest`` verified."""
        status = await asyncio.to_thread(self.client.deployment_status, deployment)
        for version in status.versions:
            if version.digest == digest:
                failures = tuple(f"{p.node}: {p.problem.message}" for p in version.problems)
                return FleetCount(status.nodes, version.nodes_ready, failures)
        return FleetCount(status.nodes, 0)

    async def loads(self, deployment: str, digest: str) -> dict[str, NodeLoad]:
        """node -> how its model servers fared loading ``digest`` for ``deployment`` (nodes reporting it)."""
        answer = await asyncio.to_thread(self.client.version_loads, deployment, digest)
        return {n.node: NodeLoad(n.loaded, n.failures) for n in answer.nodes}
