"""The operator under the failures a cluster brings: a crash mid-rollout, conflicting writers, two replicas.

Real kopf operators (in this process, or a real ``python -m controlplane.k8s`` process where a
crash must be a real one) against kmock with optimistic concurrency (``VersionedEmulator``). Who
wrote what is read from kmock's request log: each operator's client names itself in its
User-Agent (``weightship-operator/<identity>``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import kmock
import pytest

from tests.kubernetes.conftest import NAMESPACE, OperatorProcess, Operators, VersionedEmulator
from tests.kubernetes.rollout_parts import WAIT, deployed, paused_canary, replicasets, status, stored, verb
from weightship.testing import eventually_async

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("replicaset_controller")]

#: Two canary steps with an indefinite pause after each: where a rollout is shows in its weight.
TWO_STEPS: list[Any] = [{"setWeight": 25}, {"pause": {}}, {"setWeight": 50}, {"pause": {}}]
AGENT = "weightship-operator/"


def writes(server: VersionedEmulator, since: int = 0) -> list[tuple[str, str, str]]:
    """(identity, method, path) of every write an operator's own client sent, from request ``since`` on."""
    out = []
    for request in list(server)[since:]:
        agent = request.headers.get("User-Agent", "")
        if request.method.name in ("POST", "PATCH", "PUT", "DELETE") and agent.startswith(AGENT):
            out.append((agent.removeprefix(AGENT), request.method.name, request.url.path))
    return out


def lease(server: VersionedEmulator) -> dict[str, Any]:
    """The operators' Lease spec as stored."""
    key = (kmock.resource("coordination.k8s.io", "v1", "leases"), NAMESPACE, "weightship-operator")
    return dict(server.objects[key].get("spec", {})) if key in server.objects else {}


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def test_an_operator_killed_mid_rollout_is_replaced_and_resumes_from_the_status(
    kmock_server: VersionedEmulator,
    operator_processes: Callable[[str], OperatorProcess],
    controlplane: tuple[str, dict[str, str]],
) -> None:
    _, digests = controlplane
    first = operator_processes("op-1")
    before = await paused_canary(kmock_server, digests, TWO_STEPS)
    paused = status(kmock_server)["engine"]
    first.kill9()  # no clean-up: the Lease is still held, whatever was in flight is lost
    mark = len(list(kmock_server))

    second = operator_processes("op-2")
    # The new process takes the Lease once it expired, then reconciles: from the stored status, not from step 0.
    await eventually_async(
        lambda: any(who == "op-2" and path.endswith("/status") for who, _, path in writes(kmock_server, mark)),
        WAIT, f"op-2 to reconcile; its log: {second.log()[-2000:]}",
    )  # fmt: skip
    resumed = status(kmock_server)["engine"]
    assert (resumed["attempt"], resumed["stepIndex"]) == (paused["attempt"], paused["stepIndex"])
    assert resumed["pauseConditions"] == paused["pauseConditions"]  # the same pause, not a new one
    assert resumed["stepEnteredAt"] == paused["stepEnteredAt"]

    await verb(kmock_server, "promote")
    now = await eventually_async(
        lambda: (s := status(kmock_server)).get("weight") == 50 and s.get("phase") == "Paused" and s, WAIT, "step 4"
    )
    assert now["step"] == "4/4"
    assert now["verbResult"] == "promote: done"
    sets = await eventually_async(
        lambda: (r := replicasets(kmock_server))[digests["v2"]]["replicas"] == 2 and r, WAIT, "the canary at 50 %"
    )
    assert {d: s["name"] for d, s in sets.items()} == {d: s["name"] for d, s in before.items()}
    created = [path for _, method, path in writes(kmock_server) if method == "POST" and path.endswith("/replicasets")]
    assert len(created) == 2, created  # one per version, over both processes: none made twice
    assert {who for who, _, _ in writes(kmock_server, mark)} == {"op-2"}


async def test_a_conflicting_write_is_re_read_and_retried_and_a_verb_applies_once(
    kmock_server: VersionedEmulator,
    operators: Operators,
    controlplane: tuple[str, dict[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="controlplane.k8s.driver")
    _, digests = controlplane
    operators.start("op-a")
    await paused_canary(kmock_server, digests, TWO_STEPS)
    epoch = status(kmock_server)["pointer"]["epoch"]

    await verb(kmock_server, "promote")
    # Another writer changes the rollout just before the operator's next write: that write carries a
    # stale resourceVersion and the API server answers 409, as a real one would.
    kmock_server.foreign_writes[("modelrollouts", "chat")] = 1
    now = await eventually_async(
        lambda: (s := status(kmock_server)).get("weight") == 50 and s.get("phase") == "Paused" and s, WAIT, "step 4"
    )
    assert kmock_server.conflicts >= 1
    assert "rollout.conflict" in caplog.text
    assert (now["step"], now["verbResult"]) == ("4/4", "promote: done")  # promoted once: not past step 4
    assert now["pointer"]["epoch"] == epoch + 1  # one pointer move for one promote
    assert stored(kmock_server, "chat")["metadata"]["annotations"]["other-writer"] == "1"  # the other write kept
    sets = replicasets(kmock_server)
    assert (sets[digests["v1"]]["replicas"], sets[digests["v2"]]["replicas"]) == (2, 2)


async def test_of_two_operator_replicas_one_acts_and_the_other_only_after_the_lease_expires(
    kmock_server: VersionedEmulator,
    operator_processes: Callable[[str], OperatorProcess],
    controlplane: tuple[str, dict[str, str]],
) -> None:
    _, digests = controlplane
    first = operator_processes("op-a")
    await eventually_async(lambda: lease(kmock_server).get("holderIdentity") == "op-a", WAIT, "op-a to lead")
    operator_processes("op-b")
    await paused_canary(kmock_server, digests)
    held = lease(kmock_server)
    assert held["holderIdentity"] == "op-a"
    assert {who for who, _, _ in writes(kmock_server)} == {"op-a"}  # the follower wrote nothing at all

    first.stop()  # a clean stop does not release the Lease: op-b waits until it expires
    # Counted once op-a has exited: a write it had in flight when SIGTERM came may still land.
    mark = len(list(kmock_server))
    last_renewal = _time(lease(kmock_server)["renewTime"])
    taken = await eventually_async(
        lambda: (held_now := lease(kmock_server)).get("holderIdentity") == "op-b" and held_now, WAIT, "op-b to lead"
    )
    assert taken["leaseTransitions"] == held["leaseTransitions"] + 1
    assert _time(taken["acquireTime"]) >= last_renewal + timedelta(seconds=held["leaseDurationSeconds"])

    await verb(kmock_server, "promote-full")
    await deployed(kmock_server, digests["v2"])
    after = writes(kmock_server, mark)
    assert {who for who, _, _ in after} == {"op-b"}, after
