"""ModelRollouts driven end to end: real kopf operators, the real ``kubernetes`` client, kmock as the API.

Each test creates a ``ModelRollout`` through the API (so kopf sees it on its watch), lets the
operator work, and reads what a user would: the ReplicaSets, the resource's status and events.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from tests.kubernetes.conftest import Operators, VersionedEmulator, Webhook
from tests.kubernetes.rollout_parts import (
    WAIT,
    analysis,
    apply,
    deployed,
    event_reasons,
    paused_canary,
    reconciles,
    replicasets,
    rollout,
    status,
    verb,
)
from weightship.client import Client
from weightship.schemas import NodeEnrolRequest, NodeHeartbeat, NodeServeMetrics, VersionServeMetrics
from weightship.testing import eventually_async

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("replicaset_controller")]


class Node:
    """A node's agent as the control plane sees it: registered with its own token, heartbeating its model servers' counters."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.since = datetime.now(UTC)
        with Client(url, "ws_test-bootstrap-admin-0123456789abcdef") as admin:
            enrolment = admin.create_token(name, "agent").token
        with Client(url, enrolment) as client:
            enrolled = client.enrol_node(NodeEnrolRequest(name=name))
        self.token, self.id = enrolled.token, enrolled.node.id

    async def report(self, deployment: str, digest: str, *, failed: int) -> None:
        """Heartbeat that the node's model servers failed ``failed`` loads of ``digest`` so far (cumulative)."""
        counters = VersionServeMetrics(deployment=deployment, digest=digest, validations_failed=failed, instances=1)
        beat = NodeHeartbeat(serve=NodeServeMetrics(since=self.since, versions=[counters]))

        def send() -> None:
            with Client(self.url, self.token) as client:
                client.heartbeat(self.id, beat)

        await asyncio.to_thread(send)


async def test_rollout_steps_then_failed_analysis_rolls_back_to_the_running_stable_replicaset(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], webhook: Webhook
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])
    assert replicasets(kmock_server)[digests["v1"]]["replicas"] == 4

    webhook.answers = [{"value": 0.001}, {"value": 0.5}]  # healthy once, then failing for good
    await apply(kmock_server, rollout("v2", [{"setWeight": 25}, analysis(webhook.url, count=3), {"setWeight": 50}]))
    await eventually_async(lambda: replicasets(kmock_server)[digests["v2"]]["role"] == "canary", WAIT, "a canary")
    await eventually_async(lambda: status(kmock_server).get("phase") == "Degraded", WAIT, "the analysis to fail")

    current = status(kmock_server)
    assert current["engine"]["abortReason"] == "AnalysisFailed"
    assert current["stable"] == digests["v1"]
    assert not current.get("canary")
    sets = await eventually_async(
        lambda: (r := replicasets(kmock_server)) and r[digests["v1"]]["replicas"] == 4 and r, WAIT, "stable back"
    )
    assert sets[digests["v1"]]["role"] == "stable"
    assert sets.get(digests["v2"], {"replicas": 0})["replicas"] == 0  # the canary's pods are gone at once
    assert {c["type"]: c["status"] for c in current["conditions"]}["Degraded"] == "True"
    assert {call["canary"] for call in webhook.calls} == {digests["v2"]}


async def test_unknown_version_is_refused_with_a_status_condition_and_no_replicaset(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    operators.start("op-a")
    await apply(kmock_server, rollout("v99", [{"setWeight": 10}]))
    current = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Invalid" and s, WAIT, "the refusal"
    )
    conditions = {c["type"]: c for c in current["conditions"]}
    assert conditions["VersionResolved"]["status"] == "False"
    assert conditions["VersionResolved"]["reason"] == "UnknownVersion"
    assert "'v99'" in conditions["VersionResolved"]["message"]
    assert "publish it or fix spec.version" in current["message"]
    assert replicasets(kmock_server) == {}
    await eventually_async(lambda: "UnknownVersion" in event_reasons(kmock_server), WAIT, "a Warning event")


async def test_a_spec_the_crd_schema_lets_through_but_the_engine_refuses_gets_a_spec_valid_false_condition(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], webhook: Webhook
) -> None:
    broken = analysis(webhook.url)
    broken["analysis"]["metrics"][0]["successCondition"] = "result <"  # a string to the schema; no expression
    operators.start("op-a")
    await apply(kmock_server, rollout("v2", [{"setWeight": 10}, broken]))
    current = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Invalid" and s, WAIT, "the refusal"
    )
    conditions = {c["type"]: c for c in current["conditions"]}
    assert (conditions["SpecValid"]["status"], conditions["SpecValid"]["reason"]) == ("False", "InvalidSpec")
    assert "successCondition: 'result <' is not a valid expression" in current["message"]
    assert replicasets(kmock_server) == {}
    assert webhook.calls == []


async def test_promote_full_relabels_the_canary_stable_and_keeps_the_previous_scaled(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    before = await paused_canary(kmock_server, digests)
    assert (before[digests["v1"]]["replicas"], before[digests["v2"]]["replicas"]) == (3, 1)

    await verb(kmock_server, "promote-full")
    await deployed(kmock_server, digests["v2"])

    sets = await eventually_async(
        lambda: (r := replicasets(kmock_server))[digests["v2"]]["replicas"] == 4 and r, WAIT, "full scale"
    )
    assert sets[digests["v2"]]["role"] == "stable"
    assert sets[digests["v2"]]["name"] == before[digests["v2"]]["name"]  # the same ReplicaSet relabelled: no restart
    # The previous stable keeps every pod it had for the rollback window: rolling back needs no new pod.
    assert sets[digests["v1"]] == {**before[digests["v1"]], "role": "previous"}
    assert status(kmock_server)["verbResult"] == "promote-full: done"
    await eventually_async(lambda: "Promoted" in event_reasons(kmock_server), WAIT, "a Promoted event")


async def test_abort_returns_traffic_to_stable_and_retry_starts_a_new_attempt(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await paused_canary(kmock_server, digests)

    await verb(kmock_server, "abort")
    aborted = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Degraded" and s, WAIT, "the abort"
    )
    assert aborted["verbResult"] == "abort: done"
    assert (aborted["stable"], aborted.get("canary"), aborted["weight"]) == (digests["v1"], None, 0)
    await eventually_async(
        lambda: replicasets(kmock_server) == {digests["v1"]: {**replicasets(kmock_server)[digests["v1"]],
                                                               "role": "stable", "replicas": 4}},
        WAIT, "the canary ReplicaSet gone and the stable one at full size",
    )  # fmt: skip
    await eventually_async(lambda: "RolledBack" in event_reasons(kmock_server), WAIT, "a RolledBack event")

    await verb(kmock_server, "retry")
    retried = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Paused" and s.get("canary") and s, WAIT, "the retry"
    )
    assert retried["verbResult"] == "retry: done"
    assert retried["engine"]["attempt"] == 2
    assert (retried["stable"], retried["canary"], retried["weight"]) == (digests["v1"], digests["v2"], 25)
    sets = await eventually_async(
        lambda: (r := replicasets(kmock_server))[digests["v2"]]["replicas"] == 1 and r, WAIT, "a canary again"
    )
    assert sets[digests["v2"]]["role"] == "canary"
    assert sets[digests["v1"]] | {"name": ""} == {"role": "stable", "replicas": 3, "name": ""}


async def test_a_rollback_inside_the_window_reuses_the_previous_replicaset_and_after_it_the_pods_go(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    window = {"rollbackWindowSeconds": 600, "scaleDownDelaySeconds": 0}
    await apply(kmock_server, rollout("v1", [], **window))
    await deployed(kmock_server, digests["v1"])
    await apply(kmock_server, rollout("v2", [], **window))
    await deployed(kmock_server, digests["v2"])
    before = await eventually_async(
        lambda: (r := replicasets(kmock_server))[digests["v2"]]["replicas"] == 4 and r, WAIT, "v2 at full size"
    )
    assert before[digests["v1"]] | {"name": ""} == {"role": "previous", "replicas": 4, "name": ""}

    # Back to v1 inside the window: its ReplicaSet, pods still running, becomes stable again.
    await apply(kmock_server, rollout("v1", [], **window))
    await deployed(kmock_server, digests["v1"])
    sets = replicasets(kmock_server)
    assert sets[digests["v1"]] == {**before[digests["v1"]], "role": "stable"}  # same object, same 4 pods
    created = [r for r in kmock_server if r.method.name == "POST" and r.url.path.endswith("/replicasets")]
    assert len(created) == 2  # nothing was built again

    # A window of 1 s: once it passed, the previous version's pods are scaled away and the ReplicaSet deleted.
    await apply(kmock_server, rollout("v2", [], rollbackWindowSeconds=1, scaleDownDelaySeconds=0))
    await deployed(kmock_server, digests["v2"])
    await eventually_async(lambda: digests["v1"] not in replicasets(kmock_server), WAIT, "v1's ReplicaSet to go")
    assert replicasets(kmock_server)[digests["v2"]]["replicas"] == 4


async def test_a_canary_its_model_servers_refuse_rolls_back_at_once_and_a_retry_waits_for_a_fresh_load(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]]
) -> None:
    url, digests = controlplane
    node = Node(url, "node-a")
    await node.report("chat-prod", digests["v2"], failed=1)  # an earlier rollout's failure: not this one's
    operators.start("op-a")
    await paused_canary(kmock_server, digests)
    await reconciles(kmock_server, 3)
    assert status(kmock_server)["phase"] == "Paused"

    await node.report("chat-prod", digests["v2"], failed=2)  # the canary pod's load fails validation
    aborted = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Degraded" and s, WAIT, "the canary refused"
    )  # no progress deadline waited for: the rollout's default is 600 s
    assert aborted["engine"]["abortReason"] == "CanaryRefused"
    assert "node-a: its model servers refused the version (1 failed load(s) or validation(s))" in aborted["message"]
    assert (aborted["stable"], aborted.get("canary")) == (digests["v1"], None)
    await eventually_async(
        lambda: replicasets(kmock_server).get(digests["v2"], {"replicas": 0})["replicas"] == 0, WAIT, "no canary pod"
    )

    await verb(kmock_server, "retry")  # counts from now: the failures so far are the last attempt's
    await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Paused" and s.get("canary"), WAIT, "the retry"
    )
    await reconciles(kmock_server, 3)
    assert status(kmock_server)["phase"] == "Paused"
    await node.report("chat-prod", digests["v2"], failed=3)
    again = await eventually_async(
        lambda: (s := status(kmock_server)).get("phase") == "Degraded" and s, WAIT, "the retry's canary refused"
    )
    assert (again["engine"]["abortReason"], again["engine"]["attempt"]) == ("CanaryRefused", 2)
