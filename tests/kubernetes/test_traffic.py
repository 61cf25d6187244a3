"""Traffic routers: Service selectors (weights stay replica shares) and a Gateway API HTTPRoute's weights.

Real kopf operator, real ``kubernetes`` client, kmock as the API server holding the Services and
the HTTPRoute the user created; the test reads them back as a user would.
"""

from __future__ import annotations

from typing import Any

import kmock
import pytest

from controlplane.k8s.rollout import digest_label
from tests.kubernetes.conftest import NAMESPACE, Operators, VersionedEmulator
from tests.kubernetes.rollout_parts import WAIT, deployed, paused_canary, replicasets, status, verb
from weightship.testing import eventually_async

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("replicaset_controller")]

HTTPROUTES = "gateway.networking.k8s.io/v1/httproutes"


async def create(server: VersionedEmulator, path: str, body: dict[str, Any]) -> None:
    """What ``kubectl create`` does: POST the object."""
    answer = await server.post(path, json=body)
    assert answer.status in (200, 201), await answer.text()


async def services(server: VersionedEmulator) -> None:
    """The user's two Services, both selecting every chat pod until the operator pins them."""
    for name in ("chat-stable", "chat-canary"):
        await create(server, f"/api/v1/namespaces/{NAMESPACE}/services", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"selector": {"app": "chat"}, "ports": [{"port": 8000}]},
        })  # fmt: skip


def selector(server: VersionedEmulator, name: str) -> dict[str, str]:
    """A Service's selector as stored."""
    return dict(server.objects[kmock.resource("", "v1", "services"), NAMESPACE, name]["spec"]["selector"])


def weights(server: VersionedEmulator) -> dict[str, int]:
    """backend Service -> weight in the HTTPRoute ``chat``."""
    route = server.objects[kmock.resource("gateway.networking.k8s.io", "v1", "httproutes"), NAMESPACE, "chat"]
    return {ref["name"]: ref["weight"] for rule in route["spec"]["rules"] for ref in rule["backendRefs"]}


async def test_service_selectors_pin_each_version_and_an_aborted_canary_drains_for_the_scale_down_delay(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    _, digests = controlplane
    await services(kmock_server)
    operators.start("op-a")
    routing = {"services": {"stable": "chat-stable", "canary": "chat-canary"}}
    sets = await paused_canary(kmock_server, digests, trafficRouting=routing, scaleDownDelaySeconds=3)

    # Selectors alone weigh nothing: the share is still the canary's share of the pods.
    assert (sets[digests["v1"]]["replicas"], sets[digests["v2"]]["replicas"]) == (3, 1)
    v1, v2 = digest_label(digests["v1"]), digest_label(digests["v2"])
    assert selector(kmock_server, "chat-stable") == {"app": "chat", "weightship.io/digest": v1}
    assert selector(kmock_server, "chat-canary") == {"app": "chat", "weightship.io/digest": v2}

    await verb(kmock_server, "abort")
    await eventually_async(lambda: status(kmock_server).get("phase") == "Degraded", WAIT, "the abort")
    assert selector(kmock_server, "chat-canary")["weightship.io/digest"] == v1  # its traffic moved at once
    retired = replicasets(kmock_server)[digests["v2"]]
    assert (retired["role"], retired["replicas"]) == ("retired", 1)  # its pods drain for scaleDownDelaySeconds
    await eventually_async(
        lambda: replicasets(kmock_server).get(digests["v2"], {"replicas": 0})["replicas"] == 0, WAIT, "the drain"
    )
    assert replicasets(kmock_server)[digests["v1"]]["replicas"] == 4


async def test_an_httproute_carries_the_weights_while_the_stable_replicaset_stays_full(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    _, digests = controlplane
    kmock_server.resources[HTTPROUTES] = kmock.ResourceInfo(
        kind="HTTPRoute", namespaced=True, verbs={"get", "list", "watch", "patch", "create", "delete"}
    )
    await services(kmock_server)
    await create(kmock_server, f"/apis/{HTTPROUTES.rsplit('/', 1)[0]}/namespaces/{NAMESPACE}/httproutes", {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "chat", "namespace": NAMESPACE},
        "spec": {"parentRefs": [{"name": "public"}], "rules": [{"backendRefs": [
            {"name": "chat-stable", "port": 8000, "weight": 100}, {"name": "chat-canary", "port": 8000, "weight": 0},
        ]}]},
    })  # fmt: skip
    operators.start("op-a")
    routing = {"httpRoute": {"name": "chat", "stableService": "chat-stable", "canaryService": "chat-canary"}}
    sets = await paused_canary(kmock_server, digests, trafficRouting=routing)

    assert weights(kmock_server) == {"chat-stable": 75, "chat-canary": 25}
    assert (sets[digests["v1"]]["replicas"], sets[digests["v2"]]["replicas"]) == (4, 1)
    assert selector(kmock_server, "chat-canary")["weightship.io/digest"] == digest_label(digests["v2"])

    await verb(kmock_server, "promote-full")
    await deployed(kmock_server, digests["v2"])
    await eventually_async(lambda: weights(kmock_server)["chat-canary"] == 0, WAIT, "all traffic on the new stable")
    assert selector(kmock_server, "chat-stable")["weightship.io/digest"] == digest_label(digests["v2"])
    sets = await eventually_async(
        lambda: (r := replicasets(kmock_server))[digests["v2"]]["replicas"] == 4 and r, WAIT, "v2 at full size"
    )
    assert sets[digests["v1"]] | {"name": ""} == {"role": "previous", "replicas": 4, "name": ""}
