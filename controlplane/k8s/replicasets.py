"""One ReplicaSet per version digest, built from the rollout's pod template; shares as replica counts.

Every version of a rollout gets its own ReplicaSet, named ``<rollout>-<first 10 hex digits of the
digest>-<template hash>``. The template hash (:func:`template_hash`, also the
``weightship.io/template-hash`` label) covers what the ModelRollout says about its pods (the pod
template and ``spec.agent``), as a Deployment's ``pod-template-hash`` does: editing the template
makes a new ReplicaSet for the same version, which the driver rolls to (surge first, the old pods
go only as new ones are ready). What the operator adds from its own configuration (the waiter's
image, the agent's paths) is not hashed, so upgrading the operator restarts no model server.
Its pods carry ``weightship.io/rollout``, ``weightship.io/digest`` and
``weightship.io/template-hash`` labels (the selector; Services select by digest only), the
full digest in the ``weightship.io/digest`` annotation and in ``WEIGHTSHIP_DIGEST`` in every
container, and an init container (``python -m controlplane.k8s.waiter``) that holds the pod until
the node's agent reports that version verified on disk, so a model server never starts on bytes
that are not there yet. The init container asks the agent over its socket, and every model-server
container gets the node's ``versions/`` directory (read-only) and the socket directory mounted at
the same paths as on the node (:class:`AgentPaths`; the template's own mounts at those paths win).
Which role a ReplicaSet plays (stable, canary, previous, retired) is a
label on the ReplicaSet object only: changing it (promotion) touches no pod.

A canary share becomes replicas with :func:`split_replicas`: unless a router weighs traffic,
traffic follows pods, so the canary gets ``ceil(share × replicas)`` and the stable ReplicaSet the
rest (Argo Rollouts' replica-based weights; Service selectors alone only split which pods each
Service reaches). With a weighing router (an HTTPRoute), the stable ReplicaSet stays at full size
and the router moves the traffic.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.k8s.rollout import (
    ANNOTATION_DIGEST,
    LABEL_DIGEST,
    LABEL_ROLE,
    LABEL_ROLLOUT,
    LABEL_TEMPLATE_HASH,
    ModelRolloutSpec,
    digest_label,
)

__all__ = [
    "DEFAULT_WAIT_IMAGE",
    "AgentPaths",
    "build_replicaset",
    "replicaset_name",
    "split_replicas",
    "surge",
    "template_hash",
]

DEFAULT_WAIT_IMAGE = "weightship:latest"
VOLUME_VERSIONS = "weightship-versions"
VOLUME_SOCKET = "weightship-agent-socket"


@dataclass(frozen=True)
class AgentPaths:
    """Where the node's agent keeps versions and its socket (the chart's ``agent.hostDataDir``/``socketDir``).

    Pods mount both at the same paths as on the node, because the agent hands out paths under
    ``<data_dir>/versions``; only ``versions/`` is mounted (read-only), never ``state/``.
    """

    data_dir: str = "/var/lib/weightship"
    socket_dir: str = "/run/weightship"

    @property
    def versions(self) -> str:
        """The host directory holding verified versions."""
        return f"{self.data_dir.rstrip('/')}/versions"

    @property
    def socket(self) -> str:
        """The agent's local API socket."""
        return f"{self.socket_dir.rstrip('/')}/agent.sock"


def _mount(container: dict[str, Any], path: str, volume: str, *, read_only: bool) -> None:
    """Mount ``volume`` at ``path`` unless the template mounts something there already (its choice wins)."""
    mounts = container.setdefault("volumeMounts", [])
    if not any(m.get("mountPath") == path for m in mounts):
        mounts.append({"name": volume, "mountPath": path, "readOnly": read_only})


def template_hash(spec: ModelRolloutSpec) -> str:
    """10 hex digits naming the pod template and agent settings of ``spec`` (canonical JSON, SHA-256)."""
    hashed = {"template": spec.template, "agent": {"port": spec.agent_port, "image": spec.agent_image}}
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:10]


def replicaset_name(rollout: str, digest: str, template: str) -> str:
    """``<rollout>-<first 10 hex digits of digest>-<template hash>``."""
    return f"{rollout}-{digest.removeprefix('sha256:')[:10]}-{template}"


def surge(replicas: int) -> int:
    """How many pods above ``replicas`` a template roll may add at once (a Deployment's default 25 %)."""
    return max(1, math.ceil(replicas * 0.25))


def split_replicas(share: float, replicas: int, *, routed: bool) -> tuple[int, int]:
    """(stable, canary) replica counts for a canary ``share`` of ``replicas``."""
    if share <= 0:
        return replicas, 0
    canary = min(replicas, max(1, math.ceil(share * replicas - 1e-9)))
    return (replicas if routed else replicas - canary), canary


def build_replicaset(
    *,
    rollout: str,
    namespace: str,
    uid: str | None,
    spec: ModelRolloutSpec,
    digest: str,
    role: str,
    replicas: int,
    wait_image: str = DEFAULT_WAIT_IMAGE,
    paths: AgentPaths = AgentPaths(),
    wait_deadline: float | None = None,
) -> dict[str, Any]:
    """The ReplicaSet of ``digest`` for ``rollout``, owned by the ModelRollout (garbage-collected with it)."""
    hashed = template_hash(spec)
    selector = {LABEL_ROLLOUT: rollout, LABEL_DIGEST: digest_label(digest), LABEL_TEMPLATE_HASH: hashed}
    template: dict[str, Any] = copy.deepcopy(dict(spec.template))
    metadata = template.setdefault("metadata", {})
    metadata["labels"] = {**(metadata.get("labels") or {}), **selector}
    metadata["annotations"] = {**(metadata.get("annotations") or {}), ANNOTATION_DIGEST: digest}
    pod = template["spec"]
    digest_env = {"name": "WEIGHTSHIP_DIGEST", "value": digest}
    deployment_env = {"name": "WEIGHTSHIP_DEPLOYMENT", "value": spec.deployment}
    # Where the version directories are mounted (the chart's agent.hostDataDir + /versions), so a
    # server reads "$WEIGHTSHIP_VERSIONS_DIR/<hex of WEIGHTSHIP_DIGEST>" whatever the node layout.
    versions_env = {"name": "WEIGHTSHIP_VERSIONS_DIR", "value": paths.versions}
    ours = ("WEIGHTSHIP_DIGEST", "WEIGHTSHIP_DEPLOYMENT", "WEIGHTSHIP_VERSIONS_DIR")
    for container in pod["containers"]:
        kept = [e for e in container.get("env") or [] if e.get("name") not in ours]
        container["env"] = [*kept, digest_env, deployment_env, versions_env]
        _mount(container, paths.versions, VOLUME_VERSIONS, read_only=True)
        _mount(container, paths.socket_dir, VOLUME_SOCKET, read_only=False)
    if spec.agent_port is None:
        agent_env: list[dict[str, Any]] = [{"name": "WEIGHTSHIP_AGENT_URL", "value": f"unix:{paths.socket}"}]
    else:  # an agent whose local API listens on the node's network instead of the socket
        agent_env = [
            {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "WEIGHTSHIP_AGENT_URL", "value": f"http://$(HOST_IP):{spec.agent_port}"},
        ]
    waiter: dict[str, Any] = {
        "name": "weightship-wait-for-version",
        "image": spec.agent_image or wait_image,
        "command": ["python", "-m", "controlplane.k8s.waiter"],
        "env": [digest_env, deployment_env, *agent_env],  # the deployment: the agent stages what its pointer names
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
    }
    if wait_deadline is not None:  # the chart's operator.waitDeadlineSeconds; else the waiter's own default
        waiter["env"].append({"name": "WEIGHTSHIP_WAIT_DEADLINE", "value": f"{wait_deadline:g}"})
    _mount(waiter, paths.socket_dir, VOLUME_SOCKET, read_only=False)
    pod["initContainers"] = [waiter, *(c for c in pod.get("initContainers") or [] if c.get("name") != waiter["name"])]
    own = {VOLUME_VERSIONS: paths.versions, VOLUME_SOCKET: paths.socket_dir}
    volumes = [v for v in pod.get("volumes") or [] if v.get("name") not in own]
    pod["volumes"] = [
        *volumes,
        *({"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}} for name, path in own.items()),
    ]
    owner: list[Mapping[str, Any]] = []
    if uid:
        owner = [
            {
                "apiVersion": "weightship.io/v1alpha1",
                "kind": "ModelRollout",
                "name": rollout,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": replicaset_name(rollout, digest, hashed),
            "namespace": namespace,
            "labels": {**selector, LABEL_ROLE: role},
            "annotations": {ANNOTATION_DIGEST: digest},
            "ownerReferences": owner,
        },
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector}, "template": template},
    }
