"""One ReplicaSet per version digest, built from the rollout's pod template; shares as replica counts.

Every version of a rollout gets its own ReplicaSet, named ``<rollout>-<first 10 hex digits>``.
Its pods carry ``weightship.io/rollout`` and ``weightship.io/digest`` labels (the selector), the
full digest in the ``weightship.io/digest`` annotation and in ``WEIGHTSHIP_DIGEST`` in every
container, and an init container (``python -m controlplane.k8s.waiter``) that holds the pod until
the node's agent reports that version verified on disk, so a model server never starts on bytes
that are not there yet. Which role a ReplicaSet plays (stable, canary, previous, retired) is a
label on the ReplicaSet object only: changing it (promotion) touches no pod.

A canary share becomes replicas with :func:`split_replicas`: without a traffic router, traffic
follows pods, so the canary gets ``ceil(share × replicas)`` and the stable ReplicaSet the rest
(Argo Rollouts' replica-based weights). With a router, the stable ReplicaSet stays at full size and
the router moves the traffic.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from controlplane.k8s.rollout import (
    ANNOTATION_DIGEST,
    LABEL_DIGEST,
    LABEL_ROLE,
    LABEL_ROLLOUT,
    ModelRolloutSpec,
    digest_label,
)

__all__ = ["DEFAULT_WAIT_IMAGE", "build_replicaset", "replicaset_name", "split_replicas"]

DEFAULT_WAIT_IMAGE = "weightship:latest"


def replicaset_name(rollout: str, digest: str) -> str:
    """``<rollout>-<first 10 hex digits of digest>``."""
    return f"{rollout}-{digest.removeprefix('sha256:')[:10]}"


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
) -> dict[str, Any]:
    """The ReplicaSet of ``digest`` for ``rollout``, owned by the ModelRollout (garbage-collected with it)."""
    selector = {LABEL_ROLLOUT: rollout, LABEL_DIGEST: digest_label(digest)}
    template: dict[str, Any] = copy.deepcopy(dict(spec.template))
    metadata = template.setdefault("metadata", {})
    metadata["labels"] = {**(metadata.get("labels") or {}), **selector}
    metadata["annotations"] = {**(metadata.get("annotations") or {}), ANNOTATION_DIGEST: digest}
    pod = template["spec"]
    digest_env = {"name": "WEIGHTSHIP_DIGEST", "value": digest}
    deployment_env = {"name": "WEIGHTSHIP_DEPLOYMENT", "value": spec.deployment}
    for container in pod["containers"]:
        kept = [
            e for e in container.get("env") or [] if e.get("name") not in ("WEIGHTSHIP_DIGEST", "WEIGHTSHIP_DEPLOYMENT")
        ]
        container["env"] = [*kept, digest_env, deployment_env]
    waiter = {
        "name": "weightship-wait-for-version",
        "image": spec.agent_image or wait_image,
        "command": ["python", "-m", "controlplane.k8s.waiter"],
        "env": [
            digest_env,
            {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "WEIGHTSHIP_AGENT_URL", "value": f"http://$(HOST_IP):{spec.agent_port}"},
        ],
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
    }
    pod["initContainers"] = [waiter, *(c for c in pod.get("initContainers") or [] if c.get("name") != waiter["name"])]
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
            "name": replicaset_name(rollout, digest),
            "namespace": namespace,
            "labels": {**selector, LABEL_ROLE: role},
            "annotations": {ANNOTATION_DIGEST: digest},
            "ownerReferences": owner,
        },
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector}, "template": template},
    }
