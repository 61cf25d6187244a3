"""The rollout engine, scenario by scenario, driven by the in-memory driver in ``simulation.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from controlplane.rollouts import verbs
from controlplane.rollouts.actions import MeasureMetric, SetPointer, StageVersion
from controlplane.rollouts.analysis import AnalysisPhase
from controlplane.rollouts.engine import reconcile
from controlplane.rollouts.phases import Phase
from controlplane.rollouts.spec import RolloutSpec, parse_spec
from controlplane.rollouts.status import PauseReason, RolloutStatus
from controlplane.rollouts.steps import AbortReason
from tests.controlplane.rollouts.simulation import CANARY, OTHER, STABLE, T0, ProviderFailure, World

pytestmark = pytest.mark.timeout(30)


def error_rate(**overrides: Any) -> dict[str, Any]:
    metric: dict[str, Any] = {
        "name": "error-rate",
        "provider": {"builtin": {"metric": "errorRate"}},
        "interval": "1m",
        "count": 3,
        "successCondition": "result <= 0.01",
    }
    return metric | overrides


def make_spec(*steps: dict[str, Any], **top: Any) -> RolloutSpec:
    return parse_spec({"version": CANARY, "steps": list(steps), **top})


FULL = make_spec(
    {"prefetch": {"percent": 100}},
    {"setWeight": 10},
    {"analysis": {"metrics": [error_rate()]}},
    {"pause": {"duration": "5m"}},
    {"setWeight": 50},
    {"analysis": {"metrics": [error_rate(), error_rate(name="p99", successCondition="result < 2.5")]}},
)
SECOND_ANALYSIS = 5


def test_rollout_that_passes_every_step_ends_healthy_with_the_canary_stable() -> None:
    world = World(FULL)
    status = world.run()
    assert status.phase is Phase.HEALTHY
    assert world.pointer == (CANARY, None, 0.0)
    shares = [(w.stable, w.canary, w.canary_share) for w in world.pointer_writes]
    assert shares == [(STABLE, CANARY, 0.1), (STABLE, CANARY, 0.5), (CANARY, None, 0.0)]
    assert [r.phase for r in status.analysis_runs] == [AnalysisPhase.SUCCESSFUL, AnalysisPhase.SUCCESSFUL]
    assert all(m.count == 3 for r in status.analysis_runs for m in r.metrics)
    assert world.tick().actions == ()  # a complete rollout never acts again


def test_failure_at_second_analysis_flips_the_pointer_back_to_stable_in_the_same_reconcile() -> None:
    world = World(FULL)
    world.answers[(SECOND_ANALYSIS, "error-rate")] = [0.001, 0.2]
    world.run(until=Phase.DEGRADED)
    status = world.status
    assert status is not None
    assert status.abort_reason == AbortReason.ANALYSIS_FAILED
    assert "error-rate" in status.message
    assert "failureLimit 0" in status.message
    first, second = sorted(status.analysis_runs, key=lambda r: r.step_index)
    assert (first.phase, second.phase) == (AnalysisPhase.SUCCESSFUL, AnalysisPhase.FAILED)
    # The reconcile that folded the failing measurement already asked for the flip back.
    flip = world.pointer_writes[-1]
    assert (flip.stable, flip.canary, flip.canary_share) == (STABLE, None, 0.0)
    assert world.pointer == (STABLE, None, 0.0)
    assert world.tick().actions == ()
    assert world.status is not None
    assert world.status.phase is Phase.DEGRADED


def test_inconclusive_analysis_pauses_holding_traffic_until_promoted() -> None:
    metric = error_rate(successCondition="result < 0.01", failureCondition="result > 0.05")
    spec = make_spec({"setWeight": 20}, {"analysis": {"metrics": [metric]}}, {"setWeight": 60})
    world = World(spec)
    world.answers[(1, "error-rate")] = [0.03]  # neither condition true
    status = world.run(until=Phase.PAUSED)
    assert [p.reason for p in status.pause_conditions] == [PauseReason.INCONCLUSIVE_ANALYSIS]
    run = status.run_for_step(1)
    assert run is not None
    assert run.phase is AnalysisPhase.INCONCLUSIVE
    for _ in range(5):
        assert not [a for a in world.tick(60).actions if isinstance(a, SetPointer | MeasureMetric)]
    assert world.pointer == (STABLE, CANARY, 0.2)
    world.status = verbs.promote(spec, status, world.now)
    assert world.run().phase is Phase.HEALTHY


@pytest.mark.parametrize("no_data", [None, [], {}, float("nan"), [float("nan")], [0.001, float("nan")]])
def test_no_data_is_never_success(no_data: object) -> None:
    spec = make_spec({"setWeight": 10}, {"analysis": {"metrics": [error_rate(count=1, interval=None)]}})
    world = World(spec)
    world.answers[(1, "error-rate")] = [no_data]
    status = world.run(until=Phase.PAUSED)
    run = status.run_for_step(1)
    assert run is not None
    assert run.phase is AnalysisPhase.INCONCLUSIVE
    assert "no data" in run.metrics[0].measurements[0].message
    assert world.pointer == (STABLE, CANARY, 0.1)


def test_no_data_counted_as_error_by_policy_aborts_after_the_consecutive_error_limit() -> None:
    metric = error_rate(noData="error", consecutiveErrorLimit=2)
    world = World(make_spec({"setWeight": 10}, {"analysis": {"metrics": [metric]}}))
    world.answers[(1, "error-rate")] = [[]]
    status = world.run(until=Phase.DEGRADED)
    assert status.abort_reason == AbortReason.ANALYSIS_ERROR
    run = status.run_for_step(1)
    assert run is not None
    assert run.metrics[0].errors == 3
    assert run.metrics[0].count == 0
    assert world.pointer == (STABLE, None, 0.0)


def test_provider_errors_below_the_limit_do_not_fail_the_run() -> None:
    world = World(make_spec({"setWeight": 10}, {"analysis": {"metrics": [error_rate()]}}))
    world.answers[(1, "error-rate")] = [ProviderFailure("timeout"), 0.001, ProviderFailure("HTTP 502"), 0.002]
    status = world.run()
    metric = status.analysis_runs[0].metrics[0]
    assert (metric.phase, metric.count, metric.errors) == (AnalysisPhase.SUCCESSFUL, 3, 2)


def test_prefetch_gate_holds_traffic_until_the_share_is_staged() -> None:
    spec = make_spec({"prefetch": {"percent": 75}}, {"setWeight": 25})
    world = World(spec, staged_nodes=1, stage_failures=("node-3: disk full (quota 200 GB)",))
    for _ in range(20):
        result = world.tick(30)
        assert world.share == 0.0
        assert StageVersion(CANARY, 0.75) in result.actions
    assert world.status is not None
    assert world.status.phase is Phase.PROGRESSING
    assert "1/4 target nodes" in world.status.message
    assert "node-3: disk full" in world.status.message
    assert "no traffic moves until 75%" in world.status.message
    world.staged_nodes = 3  # 75 % exactly
    assert world.run().phase is Phase.HEALTHY


def test_progress_deadline_aborts_a_prefetch_that_cannot_finish() -> None:
    # 40 GB at 100 MB/s measured: max(600, 2 * 400 + 300) = 1100 s, not Argo's fixed 600 s.
    spec = make_spec({"prefetch": {}}, {"setWeight": 25})
    world = World(
        spec, staged_nodes=3, stage_failures=("node-3: disk full",), version_bytes=40 * 10**9, fetch_rate=100 * 10**6
    )
    world.tick()
    status = world.status
    assert status is not None
    assert status.deadline_at == T0 + timedelta(seconds=1100)
    world.now = T0 + timedelta(seconds=1099)
    assert world.tick().status.phase is Phase.PROGRESSING
    world.now = T0 + timedelta(seconds=1100)
    result = world.tick()
    assert result.status.phase is Phase.DEGRADED
    assert result.status.abort_reason == AbortReason.PROGRESS_DEADLINE
    assert "node-3: disk full" in result.status.message
    assert result.actions == (SetPointer(STABLE, None, 0.0, result.actions[0].reason, 2),)  # type: ignore[union-attr]
    assert all(w.canary_share == 0.0 for w in world.pointer_writes)


def test_progress_deadline_does_not_run_while_manually_paused() -> None:
    spec = make_spec({"setWeight": 25}, progressDeadlineSeconds=600)
    world = World(spec, canary_nodes_ready=False)
    world.tick(300)
    assert world.status is not None
    world.status = verbs.pause(spec, world.status, world.now)
    world.tick(3600)  # an hour paused
    world.status = verbs.resume(spec, world.status, world.now)  # 300 s of the deadline are left
    assert world.tick(299).status.phase is Phase.PROGRESSING
    assert world.tick(1).status.phase is Phase.PROGRESSING
    assert world.tick().status.abort_reason == AbortReason.PROGRESS_DEADLINE


def test_abort_returns_all_traffic_to_stable_at_once_and_stays_degraded() -> None:
    world = World(FULL)
    world.run(until=Phase.PAUSED)  # the timed pause step after the first analysis
    assert world.pointer == (STABLE, CANARY, 0.1)
    assert world.status is not None
    world.status = verbs.abort_rollout(FULL, world.status, world.now, "bad outputs reported by users")
    result = world.tick()
    assert [(a.stable, a.canary, a.canary_share) for a in result.actions if isinstance(a, SetPointer)] == [
        (STABLE, None, 0.0)
    ]
    assert result.status.phase is Phase.DEGRADED
    assert "bad outputs" in result.status.message
    for _ in range(20):  # level-triggered: it stays there and asks for nothing more
        assert world.tick(60).actions == ()
    assert world.stable == STABLE
    assert (world.canary, world.share) == (None, 0.0)


def test_abort_after_the_final_pointer_write_still_returns_to_stable() -> None:
    spec = make_spec({"setWeight": 10})
    world = World(spec)
    world.tick()
    world.tick()  # the last step is done: the engine writes the canary as stable
    assert world.pointer == (CANARY, None, 0.0)
    assert world.status is not None
    assert not world.status.completed  # not observed yet
    world.status = verbs.abort_rollout(spec, world.status, world.now)
    world.run(until=Phase.DEGRADED)
    assert world.pointer == (STABLE, None, 0.0)


def test_retry_starts_again_from_the_first_step_as_a_new_attempt() -> None:
    world = World(FULL)
    world.answers[(2, "error-rate")] = [0.5]
    failed = world.run(until=Phase.DEGRADED)
    world.answers.clear()
    world.status = verbs.retry(FULL, failed, world.now)
    assert world.status.step_index == 0
    assert world.status.attempt == 2
    assert world.status.analysis_runs == ()
    status = world.run()
    assert status.phase is Phase.HEALTHY
    assert {r.run_id.split("-a")[1][0] for r in status.analysis_runs} == {"2"}


def test_a_changed_spec_leaves_degraded_and_starts_over() -> None:
    world = World(FULL)
    world.answers[(2, "error-rate")] = [0.5]
    world.run(until=Phase.DEGRADED)
    world.spec = make_spec({"setWeight": 30})  # the operator edits the spec
    status = world.run()
    assert status.phase is Phase.HEALTHY
    assert status.attempt == 1
    assert world.pointer == (CANARY, None, 0.0)


def test_promote_full_skips_steps_pauses_and_analysis_even_while_paused() -> None:
    spec = make_spec({"setWeight": 10}, {"pause": {}}, {"analysis": {"metrics": [error_rate()]}}, {"setWeight": 50})
    world = World(spec)
    status = world.run(until=Phase.PAUSED)
    status = verbs.pause(spec, status, world.now)
    world.status = verbs.promote_full(spec, status, world.now)
    result = world.tick()
    assert [(a.stable, a.canary) for a in result.actions if isinstance(a, SetPointer)] == [(CANARY, None)]
    assert world.run().phase is Phase.HEALTHY
    assert world.status is not None
    assert world.status.analysis_runs == ()


def test_promote_moves_past_an_indefinite_pause_one_step_at_a_time() -> None:
    spec = make_spec({"setWeight": 10}, {"pause": {}}, {"setWeight": 40}, {"pause": {}})
    world = World(spec)
    status = world.run(until=Phase.PAUSED)
    assert world.pointer == (STABLE, CANARY, 0.1)
    assert status.step_index == 1
    world.status = verbs.promote(spec, status, world.now)
    status = world.run(until=Phase.PAUSED)
    assert world.pointer == (STABLE, CANARY, 0.4)
    assert status.step_index == 3


def test_manual_pause_holds_progress_while_analysis_keeps_judging() -> None:
    spec = make_spec({"setWeight": 10}, {"analysis": {"metrics": [error_rate()]}}, {"setWeight": 50})
    world = World(spec)
    world.tick()
    world.tick()  # the pointer is at 10 %: the analysis step starts
    assert world.status is not None
    assert world.status.step_index == 1
    world.status = verbs.pause(spec, world.status, world.now)
    for _ in range(10):
        world.tick(60)
    assert world.status.phase is Phase.PAUSED
    assert world.pointer == (STABLE, CANARY, 0.1)
    run = world.status.run_for_step(1)
    assert run is not None
    assert run.phase is AnalysisPhase.SUCCESSFUL
    world.status = verbs.resume(spec, world.status, world.now)
    assert world.run().phase is Phase.HEALTHY


def test_paused_rollout_still_aborts_on_a_failed_analysis() -> None:
    spec = make_spec({"setWeight": 10}, {"analysis": {"metrics": [error_rate()]}})
    world = World(spec)
    world.answers[(1, "error-rate")] = [0.9]
    world.tick()
    world.tick()
    assert world.status is not None
    assert world.status.step_index == 1
    world.status = verbs.pause(spec, world.status, world.now)
    assert world.run(until=Phase.DEGRADED).abort_reason == AbortReason.ANALYSIS_FAILED
    assert world.pointer == (STABLE, None, 0.0)


def _restored(status: RolloutStatus) -> RolloutStatus:
    return RolloutStatus.from_dict(json.loads(json.dumps(status.to_dict())))


def test_restart_mid_rollout_rebuilds_from_status_only_and_decides_the_same() -> None:
    world = World(FULL)
    world.answers[(SECOND_ANALYSIS, "error-rate")] = [0.001, 0.001, 0.3]
    checked = 0
    while world.status is None or world.status.phase is not Phase.DEGRADED or world.last is None or world.last.actions:
        before, observations = world.status, world.observe()
        if before is not None:
            # A fresh control plane has only the stored JSON; it must decide exactly the same.
            assert _restored(before) == before
            again = reconcile(FULL, _restored(before), observations, world.now)
            original = reconcile(FULL, before, observations, world.now)
            assert again == original
            checked += 1
        world.tick(20)
        assert checked < 400
    assert checked > 30
    assert world.pointer == (STABLE, None, 0.0)


def test_reconcile_is_level_triggered_and_never_counts_a_measurement_twice() -> None:
    world = World(FULL)
    for _ in range(12):
        world.tick(30)
    status, observations = world.status, world.observe()
    assert status is not None
    assert observations.measurements
    first = reconcile(FULL, status, observations, world.now)
    assert reconcile(FULL, status, observations, world.now) == first
    second = reconcile(FULL, first.status, observations, world.now)
    assert second.actions == first.actions
    assert second.status == first.status


def test_a_lost_pointer_write_is_asked_for_again_with_the_new_epoch() -> None:
    world = World(make_spec({"setWeight": 10}))
    result = world.reconcile()  # the action is lost: the driver crashed before writing
    (lost,) = [a for a in result.actions if isinstance(a, SetPointer)]
    world.epoch = 7  # someone else's write in between (same content)
    again = world.reconcile()
    (retried,) = [a for a in again.actions if isinstance(a, SetPointer)]
    assert replace(retried, expected_epoch=lost.expected_epoch) == lost
    assert retried.expected_epoch == 7


def test_first_deploy_skips_the_steps() -> None:
    world = World(FULL, stable=None)
    status = world.run()
    assert status.phase is Phase.HEALTHY
    assert "first deploy" in status.message
    assert world.pointer_writes == [SetPointer(CANARY, None, 0.0, world.pointer_writes[0].reason, 1)]


def test_pointer_moved_outside_the_rollout_aborts_without_fighting_it() -> None:
    world = World(FULL)
    world.run(until=Phase.PAUSED)
    world.stable, world.canary, world.share = OTHER, None, 0.0  # an operator rolled back by hand
    result = world.tick()
    assert result.status.abort_reason == AbortReason.POINTER_CHANGED
    assert result.actions == ()
    assert world.pointer == (OTHER, None, 0.0)


def test_setweight_waits_until_the_canary_nodes_serve_it() -> None:
    world = World(make_spec({"setWeight": 50}, {"pause": {}}), canary_nodes_ready=False)
    for _ in range(5):
        world.tick(10)
    assert world.status is not None
    assert world.status.step_index == 0
    assert "0/2 canary nodes serving" in world.status.message
    world.canary_nodes_ready = True
    assert world.run(until=Phase.PAUSED).step_index == 1


def test_reconcile_refuses_a_naive_clock() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        reconcile(FULL, None, World(FULL).observe(), T0.replace(tzinfo=None))
