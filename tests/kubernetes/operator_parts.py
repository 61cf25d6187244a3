"""Reading the operator's work back from the Kubernetes API: conditions, live objects, ReplicaSets."""

from __future__ import annotations

from typing import Any

import kmock

from controlplane.k8s.rollout import ANNOTATION_DIGEST, LABEL_ROLE, LABEL_TEMPLATE_HASH
from tests.kubernetes.conftest import REPLICASETS, VersionedEmulator
from tests.kubernetes.rollout_parts import status


def live(server: VersionedEmulator, resource: str) -> list[Any]:
    """The live (not deleted) objects of ``resource``."""
    return [
        server.objects[key]
        for key in list(server.objects)
        if key[0] == kmock.resource(resource) and not server.objects[key].deleted
    ]


def sets_of(server: VersionedEmulator, digest: str) -> dict[str, dict[str, Any]]:
    """name -> {role, replicas, hash} of the live ReplicaSets of ``digest``."""
    return {
        rs["metadata"]["name"]: {
            "role": rs["metadata"]["labels"][LABEL_ROLE],
            "replicas": rs["spec"]["replicas"],
            "hash": rs["metadata"]["labels"][LABEL_TEMPLATE_HASH],
        }
        for rs in live(server, REPLICASETS)
        if rs["metadata"]["annotations"][ANNOTATION_DIGEST] == digest
    }


def condition(server: VersionedEmulator, kind: str) -> dict[str, Any]:
    """The ModelRollout's condition ``kind`` (empty if absent)."""
    return next((c for c in status(server).get("conditions") or [] if c["type"] == kind), {})
