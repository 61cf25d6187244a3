"""A canary that never becomes ready ends Degraded, and a weight always moves whole nodes (at least one).

- With the engine alone: a canary node whose model server refused the version aborts the rollout
  at once (``CanaryRefused``); one that never loads it holds ``setWeight`` until the progress
  deadline aborts it (``ProgressDeadlineExceeded``), never paused for ever.
- With the fleet driver against a live control plane (the same world as ``test_resources``): the
  same two cases through heartbeats carrying the model servers' counters, and a three-node fleet
  whose ``setWeight: 10`` moves one node (rounded up), not none.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from controlplane.fleet import canary_share_for, in_canary
from controlplane.rollouts.engine import reconcile
from controlplane.rollouts.observations import FleetObservation, Observations, PointerObservation
from controlplane.rollouts.phases import Phase
from controlplane.rollouts.spec import parse_spec
from controlplane.state import AppState
from tests.controlplane.conftest import LiveControlPlane, SeedVersions
from tests.controlplane.rollouts.fleet_driving import (  # noqa: F401 - fixtures (cp_settings: no background driver)
    Headers,
    Hook,
    SimFleet,
    World,
    clock,
    cp_settings,
    hook,
    metric,
    tick,
    world,
)
from weightship.schemas import Role
from weightship.testing import ManualUTCClock

pytestmark = pytest.mark.timeout(120)

STABLE, CANARY = "sha256:" + "a" * 64, "sha256:" + "b" * 64
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _engine_spec() -> Any:
    return parse_spec({"version": CANARY, "progressDeadlineSeconds": 120, "steps": [{"setWeight": 25}, {"pause": {}}]})


def _observe(share: float, **fleet: Any) -> Observations:
    return Observations(PointerObservation(STABLE, CANARY, share, 3), FleetObservation(target_nodes=4, **fleet), 1000)


def test_engine_aborts_at_once_when_a_canary_node_refused_the_version() -> None:
    spec = _engine_spec()
    started = reconcile(spec, None, _observe(0.0), T0)
    status = reconcile(spec, started.status, _observe(0.25, canary_assigned=1, canary_refused=("node-1: refused",)), T0)

    assert status.status.phase is Phase.DEGRADED
    assert status.status.abort_reason == "CanaryRefused"
    assert "node-1: refused" in status.status.message
    assert [(a.stable, a.canary) for a in status.actions] == [(STABLE, None)]  # type: ignore[union-attr]


def test_engine_aborts_a_canary_that_never_becomes_ready_at_the_step_deadline() -> None:
    spec = _engine_spec()
    result = reconcile(spec, None, _observe(0.0), T0)
    waiting = _observe(0.25, canary_assigned=1, canary_serving=0)
    for seconds in (1, 60, 119):
        result = reconcile(spec, result.status, waiting, T0 + timedelta(seconds=seconds))
        assert result.status.phase is Phase.PROGRESSING, result.status.message
    result = reconcile(spec, result.status, waiting, T0 + timedelta(seconds=120))

    assert result.status.phase is Phase.DEGRADED
    assert result.status.abort_reason == "ProgressDeadlineExceeded"
    assert "0/1 canary nodes serving" in result.status.message


def _spec(judged_by: Hook) -> dict[str, Any]:
    return {
        "version": "v2",
        "progressDeadlineSeconds": 60,
        "steps": [{"setWeight": 25}, {"analysis": {"metrics": [metric(judged_by, "quality")]}}, {"setWeight": 100}],
    }


def _canary_nodes(of: World) -> list[str]:
    pointer = of.pointer()
    return [n.name for n in of.fleet.nodes if in_canary("chat", n.name, pointer["canary_share"])]


def test_fleet_driver_rolls_back_a_canary_whose_model_server_refused_it(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [0.0]}
    world.start(_spec(hook))
    tick(world.cp)  # the canary step moves the pointer
    refusing = _canary_nodes(world)
    assert refusing

    rollout = world.run(refuse=refusing)

    assert rollout["phase"] == "Degraded", rollout
    assert "CanaryRefused" in rollout["message"], rollout
    assert refusing[0] in rollout["message"], rollout
    assert not world.get()["analysis_runs"], "no analysis runs on a canary that refused its version"
    tick(world.cp)
    assert (world.pointer()["stable"], world.pointer()["canary"]) == (world.versions["v1"], None)


def test_a_retry_after_a_refusal_waits_for_the_servers_to_load_the_canary_again(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [0.0]}
    created = world.start(_spec(hook))
    tick(world.cp)
    refusing = _canary_nodes(world)
    assert "CanaryRefused" in world.run(refuse=refusing)["message"]
    tick(world.cp)  # back on stable

    assert world.act(created["id"], "retry").status_code == 200
    # The servers still report the earlier refusal (1 failed load) until they load the canary again.
    world.fleet.canary_loads = {name: (1, 0) for name in refusing}
    assert world.run(rounds=4)["phase"] == "Progressing", "an earlier attempt's refusal ended the retry"
    world.fleet.canary_loads = {name: (1, 1) for name in refusing}  # loaded this time
    rollout = world.run(rounds=12)

    assert rollout["completed"], rollout
    assert rollout["phase"] == "Healthy", rollout


def test_fleet_driver_fails_a_canary_that_never_loads_within_the_deadline(world: World, hook: Hook) -> None:  # noqa: F811
    hook.answers = {"quality": [0.0]}
    world.start(_spec(hook))
    tick(world.cp)
    loading = [n.name for n in world.fleet.nodes]

    assert world.run(rounds=5, loading=loading)["phase"] == "Progressing"
    world.clock.advance(61)
    rollout = world.run(rounds=2, loading=loading)

    assert rollout["phase"] == "Degraded", rollout
    assert "ProgressDeadlineExceeded" in rollout["message"], rollout
    assert "canary nodes serving" in rollout["message"], rollout


def test_a_canary_whose_switch_hook_keeps_failing_is_not_serving_and_fails_at_the_deadline(
    world: World,  # noqa: F811
    hook: Hook,  # noqa: F811
) -> None:
    hook.answers = {"quality": [0.0]}
    world.start(_spec(hook))
    tick(world.cp)
    told_nobody = [n.name for n in world.fleet.nodes]

    assert world.run(rounds=5, hook_failing=told_nobody)["phase"] == "Progressing"
    assert not world.get()["analysis_runs"], "an external server never told of the canary was judged"
    world.clock.advance(61)
    rollout = world.run(rounds=2, hook_failing=told_nobody)

    assert rollout["phase"] == "Degraded", rollout
    assert "ProgressDeadlineExceeded" in rollout["message"], rollout


# --- weights move whole nodes ----------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 10, 40])
def test_a_weight_selects_at_least_its_rounded_up_share_of_nodes_and_grows_monotonically(nodes: int) -> None:
    names = [f"gpu-{i}" for i in range(nodes)]
    chosen_before: set[str] = set()
    for weight in (1, 5, 10, 25, 50, 75, 100):
        share = canary_share_for("chat", names, weight / 100)
        chosen = {n for n in names if in_canary("chat", n, share)}
        assert len(chosen) >= math.ceil(weight * nodes / 100), (weight, share)
        assert share >= weight / 100
        assert chosen >= chosen_before, "a larger weight dropped a node"
        chosen_before = chosen


def test_three_nodes_and_set_weight_10_move_one_node(
    cp_client: httpx.Client,
    role_headers: Headers,
    seed_versions: SeedVersions,
    cp_state: AppState,
    clock: ManualUTCClock,  # noqa: F811
    live_controlplane: LiveControlPlane,
    hook: Hook,  # noqa: F811
) -> None:
    versions = seed_versions("m", ("v1", "v2"))
    admin = role_headers[Role.admin]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "m"}, headers=admin).status_code == 201
    put = cp_client.put("/v1/deployments/chat/pointer", json={"stable": "v1"}, headers={**admin, "If-Match": '"0"'})
    assert put.status_code == 200, put.text
    fleet = SimFleet(live_controlplane, "chat", 3)
    fleet.converge()
    small = World(cp_client, role_headers, versions, fleet, clock, live_controlplane)
    assert not any(in_canary("chat", n.name, 0.10) for n in fleet.nodes), "the bucket rule alone moves none here"
    hook.answers = {"quality": [0.0]}
    small.start({"version": "v2", "steps": [{"setWeight": 10}, {"pause": {}}]})

    rollout = small.run(rounds=4)

    assert rollout["phase"] == "Paused", rollout  # setWeight 10 done: one node serves v2
    assert list(fleet.serving.values()).count(versions["v2"]) == 1, fleet.serving
    status = cp_client.get("/v1/deployments/chat/status", headers=admin).json()
    canary = next(v for v in status["versions"] if v["role"] == "canary")
    assert (canary["nodes_desired"], canary["nodes_serving"]) == (1, 1)
    moved = small.history()[0]
    assert "rounded up to 1 of 3 nodes" in moved["reason"], moved
    tick(live_controlplane)  # the engine sees its own weight: nothing is written again
    assert small.history()[0]["epoch"] == moved["epoch"]
