"""A ModelRollout over its life: deleted without waiting on anyone, edited, scaled, its ReplicaSets tampered with.

Real kopf operators against kmock, as in ``test_rollouts.py``. ``Pods`` stands in for the
ReplicaSet controller and the kubelets, like the shared ``replicaset_controller`` fixture, but can
hold new pods unready, so a test sees what the operator says while pods start.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from controlplane.k8s.rollout import LABEL_TEMPLATE_HASH
from tests.kubernetes.conftest import NAMESPACE, REPLICASETS, Operators, VersionedEmulator, crd
from tests.kubernetes.operator_parts import condition, live, sets_of
from tests.kubernetes.rollout_parts import BASE, WAIT, apply, deployed, rollout, status, stored
from weightship.testing import eventually_async

pytestmark = [pytest.mark.timeout(90)]

#: The finalizer kopf adds for timers and daemons (earlier operator versions used a timer).
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


class Pods:
    """Marks each ReplicaSet's pods as created and ready; with ``ready = False`` new pods stay unready."""

    def __init__(self, server: VersionedEmulator) -> None:
        self.server = server
        self.ready = True

    async def run(self) -> None:
        """Poll every 20 ms, as a controller's resync would."""
        while True:
            for obj in live(self.server, REPLICASETS):
                wanted = obj.get("spec", {}).get("replicas", 0)
                now = obj.get("status", {})
                ready = wanted if self.ready else min(wanted, now.get("readyReplicas", 0))
                if (now.get("replicas"), now.get("readyReplicas")) != (wanted, ready):
                    obj.patch({"status": {"replicas": wanted, "readyReplicas": ready}})
            await asyncio.sleep(0.02)  # ok-sleep: the stand-in controller's resync period


@pytest_asyncio.fixture
async def pods(kmock_server: VersionedEmulator) -> AsyncIterator[Pods]:
    """The stand-in controller, running for the test."""
    controller = Pods(kmock_server)
    task = asyncio.create_task(controller.run())
    yield controller
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def field(obj: Any, path: str) -> Any:
    """What a CRD's simple JSONPath (``.status.readyReplicas``) picks from ``obj``, as kubectl reads it."""
    value = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if hasattr(value, "get") else None
    return value


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` match a serialized label selector (``a=b,c in (x,y)``), as the HPA reads it."""
    for term in re.split(r",(?![^(]*\))", selector):
        if " in " in term:
            key, values = term.split(" in ", 1)
            if labels.get(key.strip()) not in {v.strip() for v in values.strip("() ").split(",")}:
                return False
        else:
            key, value = term.split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
    return True


async def delete(server: VersionedEmulator, path: str) -> None:
    """``kubectl delete``: DELETE the object."""
    answer = await server.delete(path)
    assert answer.status in (200, 202), await answer.text()


async def test_a_modelrollout_never_gets_a_finalizer_and_deletes_at_once_with_the_operator_gone(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])
    assert not stored(kmock_server, "chat")["metadata"].get("finalizers")
    finalizing = [r for r in kmock_server if r.method.name == "PATCH" and "finalizers" in str(r.data)]
    assert finalizing == []

    # The release is uninstalled with the operator first: nobody is left to release a finalizer.
    await operators.stop("op-a")
    await delete(kmock_server, f"{BASE}/chat")
    assert stored(kmock_server, "chat") is None  # gone, not left Terminating


async def test_a_finalizer_left_by_an_earlier_operator_is_removed_so_deletion_does_not_hang(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    old = rollout("v1", [])
    old["metadata"]["finalizers"] = [KOPF_FINALIZER]  # as a timer-based operator left it
    await apply(kmock_server, old)
    operators.start("op-a")
    await eventually_async(
        lambda: not stored(kmock_server, "chat")["metadata"].get("finalizers"), WAIT, "the old finalizer removed"
    )
    await deployed(kmock_server, digests["v1"])
    await delete(kmock_server, f"{BASE}/chat")
    assert stored(kmock_server, "chat") is None


async def test_a_modelrollout_stuck_terminating_on_an_old_finalizer_goes_once_an_operator_runs(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    old = rollout("v1", [])
    old["metadata"]["finalizers"] = [KOPF_FINALIZER]
    await apply(kmock_server, old)
    await delete(kmock_server, f"{BASE}/chat")  # the old operator is gone: Terminating, held by its finalizer
    assert stored(kmock_server, "chat")["metadata"]["deletionTimestamp"]
    operators.start("op-a")
    await eventually_async(lambda: stored(kmock_server, "chat") is None, WAIT, "the held ModelRollout to go")
    assert live(kmock_server, REPLICASETS) == []  # and nothing was made for it on the way out


async def test_a_modelrollout_deleted_while_the_operator_runs_is_left_alone_from_then_on(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    other = rollout("v1", [])
    other["metadata"]["name"] = "other"
    await apply(kmock_server, other)
    await deployed(kmock_server, digests["v1"])

    await delete(kmock_server, f"{BASE}/chat")  # as the namespace controller does for each object
    assert stored(kmock_server, "chat") is None
    mark = len(list(kmock_server))
    # The operator keeps working (the other rollout's status is written again, twice)...
    await eventually_async(
        lambda: sum(1 for r in list(kmock_server)[mark:] if r.url.path == f"{BASE}/other/status") >= 2,
        WAIT, "two more reconciles of the other rollout",
    )  # fmt: skip
    # ...and has stopped acting for the deleted one: nothing written, nothing created for it.
    writes = [
        (r.method.name, r.url.path)
        for r in list(kmock_server)[mark:]
        if r.method.name in ("POST", "PATCH", "PUT", "DELETE")
        and (
            r.url.path.startswith(f"{BASE}/chat")
            or r.url.path.rsplit("/", 1)[-1].startswith("chat-")
            or ((r.data or {}).get("metadata") or {}).get("name", "").startswith("chat-")
        )
    ]
    assert writes == []


async def test_editing_the_pod_template_rolls_the_pods_to_a_new_replicaset_of_the_same_version(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    first = rollout("v1", [])
    await apply(kmock_server, first)
    await deployed(kmock_server, digests["v1"])
    ((old_name, old),) = sets_of(kmock_server, digests["v1"]).items()
    assert (old["role"], old["replicas"]) == ("stable", 4)
    assert old_name.endswith(f"-{old['hash']}")

    edited = copy.deepcopy(first)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "weightship-serve:2"
    pods.ready = False  # the new pods start but are not ready yet
    mark = len(list(kmock_server))
    await apply(kmock_server, edited)
    def two_sets() -> dict[str, dict[str, Any]] | None:
        found = sets_of(kmock_server, digests["v1"])
        return found if len(found) == 2 else None

    rolling = await eventually_async(two_sets, WAIT, "a second ReplicaSet of v1")
    (new_name,) = set(rolling) - {old_name}
    assert rolling[new_name]["hash"] != old["hash"]
    assert rolling[new_name]["replicas"] == 1  # surge: one pod above the 4 wanted, while none is ready
    assert rolling[old_name]["replicas"] == 4  # no old pod goes before a new one is ready
    held = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Progressing" and s, WAIT, "Progressing while rolling"
    )
    assert condition(kmock_server, "Healthy")["reason"] == "TemplateRolling"
    assert "rolling the pods to the new template" in held["message"]

    pods.ready = True
    await eventually_async(
        lambda: sets_of(kmock_server, digests["v1"]) == {new_name: {**rolling[new_name], "replicas": 4}},
        WAIT, "the new ReplicaSet at 4 and the old one gone",
    )  # fmt: skip
    await deployed(kmock_server, digests["v1"])
    new_rs = next(rs for rs in live(kmock_server, REPLICASETS) if rs["metadata"]["name"] == new_name)
    assert new_rs["spec"]["template"]["spec"]["containers"][0]["image"] == "weightship-serve:2"
    assert new_rs["spec"]["template"]["metadata"]["labels"][LABEL_TEMPLATE_HASH] == rolling[new_name]["hash"]
    # Never more than 4 + 1 pods asked for along the way (replayed from the writes the operator sent).
    asked: dict[str, int] = {old_name: 4}
    peak = 4
    for request in list(kmock_server)[mark:]:
        name = request.url.path.rsplit("/", 1)[-1]
        if request.method.name == "DELETE" and name in asked:
            asked[name] = 0
        elif request.method.name in ("POST", "PATCH") and "replicasets" in request.url.path:
            data = request.data or {}
            replicas = (data.get("spec") or {}).get("replicas")
            if replicas is not None:
                asked[data.get("metadata", {}).get("name") or name] = replicas
        peak = max(peak, sum(asked.values()))
    assert peak == 5, asked


async def test_a_template_edit_during_a_paused_canary_rolls_both_versions_and_keeps_the_step(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])
    steps: list[Any] = [{"setWeight": 25}, {"pause": {}}]
    await apply(kmock_server, rollout("v2", steps))
    await eventually_async(lambda: status(kmock_server).get("phase") == "Paused", WAIT, "the paused canary")
    before = {d: sets_of(kmock_server, digests[d]) for d in ("v1", "v2")}
    paused = status(kmock_server)["engine"]

    edited = rollout("v2", steps)
    edited["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "MAX_BATCH", "value": "8"}]
    await apply(kmock_server, edited)

    def rolled() -> bool:
        now = {d: sets_of(kmock_server, digests[d]) for d in ("v1", "v2")}
        return all(len(now[d]) == 1 and set(now[d]).isdisjoint(before[d]) for d in now)

    await eventually_async(rolled, WAIT, "one new ReplicaSet per version, the old ones gone")
    (v1,) = sets_of(kmock_server, digests["v1"]).values()
    (v2,) = sets_of(kmock_server, digests["v2"]).values()
    assert (v1["role"], v1["replicas"], v2["role"], v2["replicas"]) == ("stable", 3, "canary", 1)  # still 25 %
    now = status(kmock_server)
    assert (now["phase"], now["weight"], now["step"]) == ("Paused", 25, "2/2")
    assert (now["engine"]["stepIndex"], now["engine"]["stepEnteredAt"]) == (paused["stepIndex"], paused["stepEnteredAt"])


async def test_a_replica_count_change_rescales_and_the_scale_subresource_reads_pods_and_selector(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])
    ((name, _),) = sets_of(kmock_server, digests["v1"]).items()

    # What `kubectl scale mro/chat --replicas=6`, an HPA or KEDA write through the scale subresource.
    answer = await kmock_server.patch(f"{BASE}/chat", json={"spec": {"replicas": 6}})
    assert answer.status == 200, await answer.text()
    await eventually_async(
        lambda: sets_of(kmock_server, digests["v1"])[name]["replicas"] == 6, WAIT, "the ReplicaSet rescaled in place"
    )
    obj = await eventually_async(
        lambda: (o := stored(kmock_server, "chat"))["status"].get("readyReplicas") == 6 and o, WAIT, "6 ready pods"
    )
    scale = crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert field(obj, scale["specReplicasPath"]) == 6
    assert field(obj, scale["statusReplicasPath"]) == 6
    selector = field(obj, scale["labelSelectorPath"])
    (rs,) = live(kmock_server, REPLICASETS)
    assert matches(selector, rs["spec"]["template"]["metadata"]["labels"])  # the HPA finds these pods
    assert not matches(selector, {**rs["spec"]["template"]["metadata"]["labels"], "weightship.io/rollout": "other"})


async def test_a_replicaset_deleted_by_hand_is_made_again_and_healthy_waits_for_its_pods(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    pods.ready = False
    await apply(kmock_server, rollout("v1", []))
    # The engine is done (v1 is stable), but no pod is ready: not Healthy.
    await eventually_async(
        lambda: condition(kmock_server, "Healthy").get("reason") == "PodsNotReady", WAIT, "Healthy=False PodsNotReady"
    )
    waiting = status(kmock_server)
    assert (waiting["phase"], waiting["stable"], waiting["readyReplicas"]) == ("Progressing", digests["v1"], 0)
    assert condition(kmock_server, "Healthy")["status"] == "False"
    assert "0 of 4 ready" in condition(kmock_server, "Healthy")["message"]
    pods.ready = True
    await deployed(kmock_server, digests["v1"])
    assert status(kmock_server)["readyReplicas"] == 4

    ((name, before),) = sets_of(kmock_server, digests["v1"]).items()
    await delete(kmock_server, f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/{name}")
    await eventually_async(
        lambda: sets_of(kmock_server, digests["v1"]) == {name: before}, WAIT, "the ReplicaSet made again"
    )
    await deployed(kmock_server, digests["v1"])


async def test_kubectl_get_shows_labels_desired_and_ready_pods(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], pods: Pods
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])
    await apply(kmock_server, rollout("v2", [{"setWeight": 25}, {"pause": {}}]))
    await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Paused" and s.get("readyReplicas") == 4,
        WAIT, "the paused canary with its pods ready",
    )  # fmt: skip
    columns = crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    row = {c["name"]: field(stored(kmock_server, "chat"), c["jsonPath"]) for c in columns if c["name"] != "Age"}
    assert row == {
        "Phase": "Paused",
        "Stable": "v1",
        "Canary": "v2",
        "Weight": 25,
        "Step": "2/2",
        "Desired": 4,
        "Ready": 4,
    }
