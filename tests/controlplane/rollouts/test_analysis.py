"""Analysis arithmetic: measurement verdicts, Argo's limits, and worst-wins across metrics."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

from controlplane.rollouts.analysis import (
    AnalysisPhase,
    AnalysisRun,
    MeasurementPhase,
    MetricRun,
    assess_run,
    judge_measurement,
    worst,
)
from controlplane.rollouts.spec import AnalysisStep, MetricSpec, parse_spec
from tests.controlplane.rollouts.simulation import CANARY, T0

pytestmark = pytest.mark.timeout(10)

S, F, INC, E = (
    MeasurementPhase.SUCCESSFUL,
    MeasurementPhase.FAILED,
    MeasurementPhase.INCONCLUSIVE,
    MeasurementPhase.ERROR,
)


def metric(**fields: Any) -> MetricSpec:
    raw = {"name": "m", "provider": {"webhook": {"url": "http://checks"}}, "successCondition": "result < 1"} | fields
    raw = {k: v for k, v in raw.items() if v is not None}
    step = parse_spec({"version": CANARY, "steps": [{"analysis": {"metrics": [raw]}}]}).steps[0]
    assert isinstance(step, AnalysisStep)
    return step.metrics[0]


BOTH = {"successCondition": "result < 1", "failureCondition": "result > 5"}


@pytest.mark.parametrize(
    ("conditions", "value", "error", "expected"),
    [
        ({}, 0.5, None, S),  # only success: true
        ({}, 3, None, F),  # only success: false
        ({"successCondition": None, "failureCondition": "result > 5"}, 3, None, S),  # only failure: false
        ({"successCondition": None, "failureCondition": "result > 5"}, 9, None, F),  # only failure: true
        (BOTH, 0.5, None, S),
        (BOTH, 9, None, F),
        (BOTH, 3, None, INC),  # neither true
        ({"successCondition": "result > 0", "failureCondition": "result > 5"}, 9, None, F),  # both true: failure wins
        ({}, 0.5, "HTTP 503 from prometheus", E),
        ({"successCondition": "result[3] < 1"}, [0.5], None, E),  # cannot evaluate
        # No data is never success: None, empty, NaN anywhere.
        ({}, None, None, INC),
        ({}, [], None, INC),
        ({}, {}, None, INC),
        ({}, math.nan, None, INC),
        ({}, [0.1, math.nan], None, INC),
        ({}, {"canary": math.nan, "stable": 0.1}, None, INC),
        ({"noData": "error"}, [], None, E),
        ({"noData": "failed"}, None, None, F),
        ({"failureCondition": "result > 5", "successCondition": None}, None, None, INC),
    ],
)
def test_each_measurement_gets_a_verdict(
    conditions: dict[str, Any], value: object, error: str | None, expected: MeasurementPhase
) -> None:
    phase, message = judge_measurement(metric(**conditions), value, error)
    assert phase is expected, message
    assert message


def fold(spec: MetricSpec, values: list[object]) -> MetricRun:
    run = MetricRun(spec.name)
    for i, value in enumerate(values):
        error = value.text if isinstance(value, Failure) else None
        run = run.record(spec, T0 + timedelta(minutes=i), None if error else value, error)
    return run


class Failure:
    def __init__(self, text: str) -> None:
        self.text = text


OK, BAD, MID, ERR, NONE = 0.5, 9, 3, Failure("timeout"), None


@pytest.mark.parametrize(
    ("limits", "values", "expected", "measured"),
    [
        # count reached, everything fine
        ({"count": 3}, [OK, OK, OK], AnalysisPhase.SUCCESSFUL, 3),
        ({"count": 3}, [OK, OK], AnalysisPhase.RUNNING, 2),
        # failureLimit 0 (Argo's default): the first failure ends it, later values are ignored
        ({"count": 3}, [OK, BAD, OK, OK], AnalysisPhase.FAILED, 2),
        ({"count": 4, "failureLimit": 1}, [BAD, OK, OK, OK], AnalysisPhase.SUCCESSFUL, 4),
        ({"count": 4, "failureLimit": 1}, [BAD, OK, BAD], AnalysisPhase.FAILED, 3),
        # inconclusiveLimit
        ({"count": 3, **BOTH}, [OK, MID], AnalysisPhase.INCONCLUSIVE, 2),
        ({"count": 3, "inconclusiveLimit": 1, **BOTH}, [MID, OK, OK], AnalysisPhase.SUCCESSFUL, 3),
        ({"count": 3}, [OK, NONE], AnalysisPhase.INCONCLUSIVE, 2),  # no data: inconclusive by default
        # consecutiveErrorLimit (default 4): errors do not count towards count, and reset on data
        ({"count": 2}, [ERR, ERR, ERR, ERR], AnalysisPhase.RUNNING, 4),
        ({"count": 2}, [ERR, ERR, ERR, ERR, ERR], AnalysisPhase.ERROR, 5),
        ({"count": 2}, [ERR, ERR, ERR, ERR, OK, ERR, ERR, ERR, ERR, OK], AnalysisPhase.SUCCESSFUL, 10),
        ({"count": 2, "consecutiveErrorLimit": 0}, [ERR], AnalysisPhase.ERROR, 1),
        ({"count": 2, "noData": "error", "consecutiveErrorLimit": 1}, [NONE, NONE], AnalysisPhase.ERROR, 2),
        ({"count": 2, "noData": "failed", "failureLimit": 1}, [NONE, OK], AnalysisPhase.SUCCESSFUL, 2),
        ({}, [], AnalysisPhase.PENDING, 0),
    ],
)
def test_metric_limits_follow_argo(
    limits: dict[str, Any], values: list[object], expected: AnalysisPhase, measured: int
) -> None:
    spec = metric(interval="1m" if limits.get("count", 1) > 1 else None, **limits)
    run = fold(spec, values)
    assert run.phase is expected, run.message
    assert len(run.measurements) == measured
    assert run.count == sum(1 for m in run.measurements if m.phase is not MeasurementPhase.ERROR)


def test_worst_result_wins_across_metrics() -> None:
    order = [
        AnalysisPhase.SUCCESSFUL,
        AnalysisPhase.RUNNING,
        AnalysisPhase.PENDING,
        AnalysisPhase.INCONCLUSIVE,
        AnalysisPhase.ERROR,
        AnalysisPhase.FAILED,
    ]
    for i, phase in enumerate(order):
        assert worst(order[: i + 1]) is phase
        assert worst(list(reversed(order[: i + 1]))) is phase


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        ([AnalysisPhase.SUCCESSFUL, AnalysisPhase.SUCCESSFUL], AnalysisPhase.SUCCESSFUL),
        ([AnalysisPhase.SUCCESSFUL, AnalysisPhase.RUNNING], AnalysisPhase.RUNNING),
        ([AnalysisPhase.PENDING, AnalysisPhase.SUCCESSFUL], AnalysisPhase.RUNNING),
        # one unsuccessful metric ends the run even while others still run; never "Successful"
        ([AnalysisPhase.RUNNING, AnalysisPhase.INCONCLUSIVE], AnalysisPhase.INCONCLUSIVE),
        ([AnalysisPhase.INCONCLUSIVE, AnalysisPhase.ERROR], AnalysisPhase.ERROR),
        ([AnalysisPhase.FAILED, AnalysisPhase.ERROR, AnalysisPhase.SUCCESSFUL], AnalysisPhase.FAILED),
    ],
)
def test_run_result_is_the_worst_metric(phases: list[AnalysisPhase], expected: AnalysisPhase) -> None:
    runs = [MetricRun(f"m{i}", phase=p, message=str(p)) for i, p in enumerate(phases)]
    assert assess_run(runs)[0] is expected


def test_run_ignores_repeated_and_out_of_order_measurements() -> None:
    spec = metric(count=3, interval="1m")
    run = AnalysisRun.start("r", 2, [spec], T0)
    run = run.record([spec], "m", 0, T0, 0.5, None)
    assert run.record([spec], "m", 0, T0, 9, None) is run  # the same measurement again
    assert run.record([spec], "m", 2, T0, 9, None) is run  # one from the future
    assert run.record([spec], "other", 1, T0, 9, None) is run  # another metric's
    assert run.metrics[0].count == 1
    assert run.phase is AnalysisPhase.RUNNING


def test_measurements_are_due_after_the_initial_delay_then_every_interval() -> None:
    spec = metric(count=3, interval="2m", initialDelay="30s")
    run = MetricRun("m")
    assert run.next_due(spec, T0) == T0 + timedelta(seconds=30)
    run = run.record(spec, T0 + timedelta(seconds=31), 0.5, None)
    assert run.next_due(spec, T0) == T0 + timedelta(seconds=151)
    run = run.record(spec, T0 + timedelta(seconds=151), 0.5, None)
    run = run.record(spec, T0 + timedelta(seconds=271), 0.5, None)
    assert run.phase is AnalysisPhase.SUCCESSFUL
    assert run.next_due(spec, T0) is None


def test_non_finite_values_are_stored_as_text() -> None:
    run = MetricRun("m").record(metric(), T0, [math.inf, 0.2], None)
    assert run.measurements[0].value == ["inf", 0.2]
