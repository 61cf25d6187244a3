"""ModelRollouts applied, acted on and read back through the Kubernetes API, for the operator tests."""

from __future__ import annotations

from typing import Any

import kmock

from controlplane.k8s.rollout import ANNOTATION_DIGEST, LABEL_ROLE
from tests.kubernetes.conftest import NAMESPACE, REPLICASETS, ROLLOUTS, VersionedEmulator
from weightship.testing import eventually_async

#: How long a test waits for the operator to get somewhere (it reconciles every 0.2 s).
WAIT = 30.0


BASE = f"/apis/weightship.io/v1alpha1/namespaces/{NAMESPACE}/modelrollouts"


def rollout(version: str, steps: list[Any], **extra: Any) -> dict[str, Any]:
    """A ModelRollout manifest for deployment chat-prod."""
    return {
        "apiVersion": "weightship.io/v1alpha1",
        "kind": "ModelRollout",
        "metadata": {"name": "chat", "namespace": NAMESPACE},
        "spec": {
            "deployment": "chat-prod",
            "version": version,
            "replicas": 4,
            "template": {
                "metadata": {"labels": {"app": "chat"}},
                "spec": {"containers": [{"name": "server", "image": "weightship-serve:1"}]},
            },
            "steps": steps,
            **extra,
        },
    }


def analysis(url: str, count: int = 2) -> dict[str, Any]:
    """An analysis step judging a webhook's error rate, one measurement every 0.2 s."""
    return {"analysis": {"metrics": [{
        "name": "error-rate", "provider": {"webhook": {"url": url, "jsonPath": "$.value", "timeout": "0.2s"}},
        "interval": "0.2s", "count": count, "successCondition": "result < 0.01",
    }]}}  # fmt: skip


def status(server: VersionedEmulator) -> dict[str, Any]:
    """The ModelRollout's status as stored."""
    obj = stored(server, "chat")
    return dict(obj.get("status", {})) if obj is not None else {}


def stored(server: VersionedEmulator, name: str) -> Any:
    """The live ModelRollout object ``name`` in kmock, or None."""
    for key in list(server.objects):
        if key[0] == kmock.resource(ROLLOUTS) and key[1:] == (NAMESPACE, name) and not server.objects[key].deleted:
            return server.objects[key]
    return None


def replicasets(server: VersionedEmulator) -> dict[str, dict[str, Any]]:
    """digest -> {role, replicas} of the live ReplicaSets."""
    out = {}
    for key in list(server.objects):
        obj = server.objects[key]
        if key[0] == kmock.resource(REPLICASETS) and not obj.deleted:
            out[obj["metadata"]["annotations"][ANNOTATION_DIGEST]] = {
                "role": obj["metadata"]["labels"][LABEL_ROLE], "replicas": obj["spec"]["replicas"],
                "name": obj["metadata"]["name"],
            }  # fmt: skip
    return out


def event_reasons(server: VersionedEmulator) -> list[str]:
    """The reasons of the Kubernetes Events posted so far (kopf posts them for the operator)."""
    events = kmock.resource("", "v1", "events")
    return [str(obj.get("reason")) for key in list(server.objects) if key[0] == events for obj in [server.objects[key]]]


async def apply(server: VersionedEmulator, body: dict[str, Any]) -> None:
    """kubectl apply: create, or patch the spec of the existing object."""
    name = body["metadata"]["name"]
    if stored(server, name) is not None:
        answer = await server.patch(f"{BASE}/{name}", json={"spec": body["spec"]})
    else:
        answer = await server.post(BASE, json=body)
    assert answer.status in (200, 201), await answer.text()


async def verb(server: VersionedEmulator, value: str) -> None:
    """What ``weightship rollout <verb>`` does to a ModelRollout: annotate it."""
    answer = await server.patch(f"{BASE}/chat", json={"metadata": {"annotations": {"weightship.io/verb": value}}})
    assert answer.status == 200, await answer.text()


async def deployed(server: VersionedEmulator, digest: str) -> None:
    """Wait until ``digest`` is the rollout's stable version and it is Healthy."""
    try:
        await eventually_async(
            lambda: status(server).get("phase") == "Healthy" and status(server).get("stable") == digest,
            WAIT, f"{digest} stable and Healthy",
        )  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {status(server)}") from None


async def reconciles(server: VersionedEmulator, count: int) -> None:
    """Wait until the operator read the rollout ``count`` more times (each reconcile reads it first)."""
    mark = len(list(server))
    await eventually_async(
        lambda: sum(1 for r in list(server)[mark:] if r.method.name == "GET" and r.url.path == f"{BASE}/chat") >= count,
        WAIT, f"{count} more reconciles",
    )  # fmt: skip


async def paused_canary(
    server: VersionedEmulator, digests: dict[str, str], steps: list[Any] | None = None, **extra: Any
) -> dict[str, dict[str, Any]]:
    """v1 deployed, then v2 rolled out up to its first indefinite pause; returns the ReplicaSets then."""
    await apply(server, rollout("v1", [], **extra))
    await deployed(server, digests["v1"])
    await apply(server, rollout("v2", steps or [{"setWeight": 25}, {"pause": {}}], **extra))
    await eventually_async(lambda: status(server).get("phase") == "Paused", WAIT, "the indefinite pause")
    return replicasets(server)
