"""Rollouts over REST, driven by the fleet driver against a live control plane (SQLite and PostgreSQL).

The app runs under uvicorn with its background driver off; each test ticks the driver itself
(on the app's loop) with a fake clock, and a simulated fleet reports through the control plane's
own fleet functions. Analysis measures through a real local webhook server.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from controlplane.persistence.rows import utcnow
from controlplane.rollout_driver import FleetRolloutDriver, Outcome
from controlplane.state import AppState
from tests.controlplane.conftest import problem
from tests.controlplane.rollouts.fleet_driving import (  # noqa: F401 - fixtures (cp_settings: no background driver)
    Hook,
    SimFleet,
    World,
    clock,
    cp_settings,
    driver_of,
    hook,
    metric,
    tick,
    world,
)
from weightship.schemas import Role
from weightship.testing import ManualUTCClock

pytestmark = pytest.mark.timeout(120)


#: ``setWeight: 25`` on these four nodes: no node's bucket is under 0.25, so the share is raised to
#: take the one whose bucket is lowest (0.3724…): a weight moves at least one node (docs/rollouts.md)
SHARE_25 = 0.3725


def two_analyses(hook: Hook, **first: Any) -> dict[str, Any]:  # noqa: F811
    return {
        "version": "v2",
        "steps": [
            {"prefetch": {"percent": 100}},
            {"setWeight": 25},
            {"analysis": {"metrics": [metric(hook, "quality", **first)]}},
            {"setWeight": 50},
            {"analysis": {"metrics": [metric(hook, "latency")]}},
        ],
    }


def test_a_rollout_that_passes_every_step_makes_the_version_stable(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [0.01], "latency": [0.05]}
    created = world.start(two_analyses(hook))
    assert created["phase"] == "Progressing"
    assert created["steps_total"] == 5
    assert created["version"] == world.versions["v2"]

    rollout = world.run()

    assert rollout["phase"] == "Healthy", rollout["message"]

    assert rollout["completed"], rollout["message"]
    assert [s["state"] for s in rollout["steps"]] == ["done"] * 5
    assert [run["phase"] for run in rollout["analysis_runs"]] == ["Successful", "Successful"]
    assert rollout["analysis_runs"][0]["metrics"][0]["measurements"][0]["value"] == 0.01
    pointer = world.pointer()
    assert (pointer["stable"], pointer["canary"]) == (world.versions["v2"], None)
    moves = [e for e in world.history() if e["actor"] == f"rollout:{created['id']}"]
    assert [e["canary_share"] for e in reversed(moves)] == [0.0, SHARE_25, 0.5, 0.0]
    assert all(e["reason"].startswith(f"rollout {created['id']}: ") for e in moves)
    assert "setWeight 25" in moves[-2]["reason"]
    assert moves[0]["action"] == "promote"
    assert rollout["nodes"] == {world.versions["v2"]: 4}
    assert rollout["staged_nodes"] == 4
    active = world.client.get("/v1/rollouts", params={"active": "true"}, headers=world.operator).json()
    assert active == {"rollouts": []}


def test_failure_at_the_second_analysis_rolls_back_automatically(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [0.01], "latency": [0.9]}
    created = world.start(two_analyses(hook))

    rollout = world.run()
    assert rollout["phase"] == "Degraded", rollout
    assert rollout["aborted"], rollout
    assert "AnalysisFailed" in rollout["message"]
    assert "latency" in rollout["message"]
    tick(world.cp)  # the rollback was written; this tick sees it and releases the deployment
    world.fleet.converge()

    pointer = world.pointer()
    assert (pointer["stable"], pointer["canary"], pointer["canary_share"]) == (world.versions["v1"], None, 0.0)
    last = world.history()[0]
    assert last["actor"] == f"rollout:{created['id']}"
    assert last["action"] == "abort"
    assert "AnalysisFailed" in last["reason"]
    assert last["epoch"] == pointer["epoch"]
    assert set(world.fleet.serving.values()) == {world.versions["v1"]}
    assert world.get(created["id"])["analysis_runs"][1]["metrics"][0]["measurements"][0]["phase"] == "Failed"
    assert world.client.get("/v1/rollouts?active=true", headers=world.operator).json() == {"rollouts": []}


def test_an_inconclusive_analysis_pauses_until_promoted(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [0.3], "latency": [0.0]}
    created = world.start(two_analyses(hook, failureCondition="result > 0.5"))

    rollout = world.run()
    assert rollout["phase"] == "Paused", rollout
    assert not rollout["aborted"], rollout
    assert rollout["analysis_runs"][0]["phase"] == "Inconclusive"
    assert world.pointer()["canary_share"] == SHARE_25

    assert world.act(created["id"], "promote").status_code == 200
    assert world.run()["completed"]


def test_no_data_is_never_counted_as_success(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [None]}
    world.start(two_analyses(hook))

    rollout = world.run()

    assert rollout["phase"] == "Paused", rollout

    assert not rollout["completed"], rollout
    (measurement,) = rollout["analysis_runs"][0]["metrics"][0]["measurements"]
    assert measurement["phase"] == "Inconclusive"
    assert measurement["value"] is None
    assert world.pointer()["stable"] == world.versions["v1"]


def test_a_prefetch_that_cannot_complete_moves_no_traffic_and_names_the_node(world: World, hook: Hook) -> None:  # noqa: F811
    world.start(two_analyses(hook))
    disk_full = {"node-2": world.versions["v2"]}

    rollout = world.run(rounds=4, disk_full=disk_full)

    assert rollout["phase"] == "Progressing", rollout

    assert rollout["step_index"] == 0, rollout
    assert "node-2: disk_full" in rollout["message"]
    assert "no space left on device" in rollout["message"]
    assert "3/4 target nodes staged" in rollout["message"]
    assert rollout["staged_nodes"] == 3
    pointer = world.pointer()
    assert pointer["canary"] == world.versions["v2"]
    assert pointer["canary_share"] == 0.0
    assert set(world.fleet.serving.values()) == {world.versions["v1"]}


def test_the_progress_deadline_aborts_a_stuck_prefetch(world: World, hook: Hook) -> None:  # noqa: F811
    spec = {**two_analyses(hook), "progressDeadlineSeconds": 60}
    world.start(spec)
    disk_full = {"node-2": world.versions["v2"]}
    assert world.run(rounds=3, disk_full=disk_full)["phase"] == "Progressing"

    world.clock.advance(61)
    rollout = world.run(rounds=2, disk_full=disk_full)

    assert rollout["phase"] == "Degraded", rollout

    assert "ProgressDeadlineExceeded" in rollout["message"], rollout
    tick(world.cp)
    pointer = world.pointer()
    assert (pointer["stable"], pointer["canary"]) == (world.versions["v1"], None)


def test_abort_retry_and_promote_full_over_rest(world: World, hook: Hook) -> None:  # noqa: F811
    spec = {"version": "v2", "steps": [{"setWeight": 25}, {"pause": {}}, {"setWeight": 50}]}
    created = world.start(spec)
    rollout_id = created["id"]
    assert world.act(rollout_id, "abort").status_code == 409  # not reconciled yet: a clear refusal
    assert world.run()["phase"] == "Paused"

    resume = world.act(rollout_id, "resume")
    assert resume.status_code == 409
    assert problem(resume)["code"] == "rollout_verb"
    assert "promote" in problem(resume)["detail"]

    aborted = world.act(rollout_id, "abort").json()
    assert aborted["aborted"]
    assert aborted["phase"] == "Degraded"
    world.run(rounds=2)
    pointer = world.pointer()
    assert (pointer["stable"], pointer["canary"]) == (world.versions["v1"], None)

    retried = world.act("current", "retry")
    assert retried.status_code == 200
    assert retried.json()["attempt"] == 2
    assert world.run()["phase"] == "Paused"
    assert world.pointer()["canary_share"] == SHARE_25

    full = world.act(rollout_id, "promote-full")
    assert full.status_code == 200
    done = world.run()
    assert done["completed"]
    assert done["phase"] == "Healthy"
    assert world.pointer()["stable"] == world.versions["v2"]
    late = world.act(rollout_id, "abort")
    assert late.status_code == 409
    assert "rollback" in problem(late)["detail"]


def test_a_second_rollout_of_a_deployment_is_refused_while_one_is_active(world: World, hook: Hook) -> None:  # noqa: F811
    first = world.start({"version": "v2", "steps": [{"pause": {}}]})

    refused = world.client.post(
        "/v1/deployments/chat/rollouts", json={"spec": {"version": "v3", "steps": []}}, headers=world.operator
    )

    assert refused.status_code == 409
    body = problem(refused)
    assert body["code"] == "rollout_active"
    assert first["id"] in body["detail"]
    assert "abort" in body["detail"]
    listed = world.client.get("/v1/deployments/chat/rollouts", headers=world.operator).json()
    assert [r["id"] for r in listed["rollouts"]] == [first["id"]]


def test_bad_specs_unknown_versions_and_publishers_get_clear_refusals(
    world: World, hook: Hook, cp_state: AppState  # noqa: F811
) -> None:
    bad = world.client.post(
        "/v1/deployments/chat/rollouts",
        json={"spec": {"version": "v2", "steps": [{"setWeight": 250}]}},
        headers=world.operator,
    )
    assert bad.status_code == 422
    assert "steps[0].setWeight" in problem(bad)["detail"]
    unknown = world.client.post(
        "/v1/deployments/chat/rollouts", json={"spec": {"version": "v9", "steps": []}}, headers=world.operator
    )
    assert unknown.status_code == 404
    missing = world.client.post(
        "/v1/deployments/nope/rollouts", json={"spec": {"version": "v2", "steps": []}}, headers=world.operator
    )
    assert missing.status_code == 404
    publisher = world.client.post(
        "/v1/deployments/chat/rollouts",
        json={"spec": {"version": "v2", "steps": []}},
        headers=world.headers[Role.publisher],
    )
    assert publisher.status_code == 403
    assert "publisher_rollouts" in problem(publisher)["detail"]
    admin = world.headers[Role.admin]
    made = world.client.post(
        "/v1/deployments", json={"name": "open", "model": "m", "publisher_rollouts": True}, headers=admin
    )
    assert made.status_code == 201
    allowed = world.client.post(
        "/v1/deployments/open/rollouts",
        json={"spec": {"version": "v2", "steps": []}},
        headers=world.headers[Role.publisher],
    )
    assert allowed.status_code == 201, allowed.text
    assert allowed.json()["created_by"] == "test-publisher"


def test_a_deposed_driver_cannot_move_the_pointer(world: World, hook: Hook, cp_state: AppState) -> None:  # noqa: F811
    created = world.start({"version": "v2", "steps": [{"setWeight": 25}, {"pause": {}}]})
    first = driver_of(world.cp)
    assert first.take_lease(created["id"])
    stale = first.observe(created["id"])  # first reads the pointer at epoch 1 ... and stalls
    assert stale is not None
    assert stale.epoch == 1

    # The live driver's lease runs on the real clock (the fake one drives only the engine): an hour
    # past real now is past its lease, whatever day the suite runs, and the second process takes over.
    later = ManualUTCClock(utcnow())
    later.advance(3600)
    second = FleetRolloutDriver(cp_state, first.providers, holder="second", clock=world.clock, lease_clock=later)
    assert second.take_lease(created["id"])
    assert not first.take_lease(created["id"])
    snapshot = second.observe(created["id"])
    assert snapshot is not None
    assert first.loop is not None
    run = asyncio.run_coroutine_threadsafe
    result = run(second.decide(snapshot), first.loop).result(30)
    assert run(second.act(snapshot, result), first.loop).result(30)[0] == Outcome.DRIVEN
    assert world.pointer()["epoch"] == 2

    # While its lease is gone, the first driver's own check stops it before any write.
    decided = run(first.decide(stale), first.loop).result(30)
    assert run(first.act(stale, decided), first.loop).result(30)[0] == Outcome.DEPOSED
    # Even if it wins a lease again (the second stalled in turn), its write from the stale read is
    # refused by the pointer's epoch compare-and-swap: fenced.
    first.lease_clock = ManualUTCClock(later.now + timedelta(hours=1))
    assert run(first.act(stale, decided), first.loop).result(30)[0] == Outcome.DEPOSED
    pointer = world.pointer()
    assert (pointer["epoch"], pointer["canary_share"]) == (2, SHARE_25)
    assert len([e for e in world.history() if e["actor"] == f"rollout:{created['id']}"]) == 1
