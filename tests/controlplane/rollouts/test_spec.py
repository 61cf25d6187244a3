"""The rollout spec: defaults, and a precise error for each thing that is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.rollouts.spec import (
    AnalysisStep,
    PauseStep,
    PrefetchStep,
    RolloutSpecError,
    SetWeightStep,
    parse_duration,
    parse_spec,
)
from tests.controlplane.rollouts.simulation import CANARY

pytestmark = pytest.mark.timeout(10)

METRIC = {"name": "error-rate", "provider": {"builtin": {"metric": "errorRate"}}, "successCondition": "result < 0.01"}


def spec_with(*steps: Any, **top: Any) -> dict[str, Any]:
    return {"version": CANARY, "steps": list(steps), **top}


def test_a_full_spec_parses_with_argo_defaults() -> None:
    spec = parse_spec(
        spec_with(
            {"prefetch": {}},
            {"setWeight": 10},
            {"analysis": {"metrics": [METRIC | {"interval": "1m", "count": 5}]}},
            {"pause": {"duration": "1h"}},
            {"pause": {}},
        )
    )
    prefetch, weight, analysis, timed, forever = spec.steps
    assert prefetch == PrefetchStep(100)
    assert weight == SetWeightStep(10)
    assert timed == PauseStep(3600.0)
    assert forever == PauseStep(None)
    assert isinstance(analysis, AnalysisStep)
    (m,) = analysis.metrics
    assert (m.count, m.interval_seconds, m.failure_limit, m.inconclusive_limit, m.consecutive_error_limit) == (
        5,
        60.0,
        0,
        0,
        4,
    )
    assert (m.no_data, m.initial_delay_seconds, m.provider_kind) == ("inconclusive", 0.0, "builtin")
    assert spec.progress_deadline_seconds is None
    assert spec.prefetch_percent == 100


def test_fingerprint_changes_with_the_spec_and_only_with_it() -> None:
    a = parse_spec(spec_with({"setWeight": 10}))
    assert a.fingerprint == parse_spec(spec_with({"setWeight": 10})).fingerprint
    assert a.fingerprint != parse_spec(spec_with({"setWeight": 20})).fingerprint


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        ([], "spec: expected a mapping"),
        ({"steps": []}, "spec.version: expected a version digest"),
        ({"version": "v7", "steps": []}, "spec.version: expected a version digest"),
        (spec_with(strategy="canary"), "spec: unknown field(s) ['strategy']"),
        (spec_with(progressDeadlineSeconds=0), "spec.progressDeadlineSeconds: expected a number >= 1"),
        ({"version": CANARY, "steps": {"setWeight": 1}}, "spec.steps: expected a list"),
        (spec_with({"setWeight": 120}), "steps[0].setWeight: expected a whole number between 0 and 100"),
        (spec_with({"setWeight": True}), "steps[0].setWeight: expected a whole number"),
        (spec_with({"setWeight": 10, "pause": {}}), "steps[0]: a step is a mapping with exactly one of"),
        (spec_with({"canaryScale": 1}), "steps[0]: unknown step kind 'canaryScale'"),
        (spec_with({"pause": {"duration": "10 minutes"}}), "steps[0].pause.duration: expected a duration"),
        (spec_with({"pause": {"until": "promoted"}}), "steps[0].pause: unknown field(s) ['until']"),
        (
            spec_with({"prefetch": {"percent": 0}}),
            "steps[0].prefetch.percent: expected a whole number between 1 and 100",
        ),
        (spec_with({"analysis": {"metrics": []}}), "steps[0].analysis.metrics: expected a non-empty list"),
        (spec_with({"analysis": {"metrics": [METRIC, METRIC]}}), "metric names must be unique"),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"name": "Error Rate"}]}}),
            ".metrics[0].name: expected a lowercase name",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"provider": {"datadog": {}}}]}}),
            ".metrics[0].provider: expected exactly one of",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"provider": {"prometheus": "up"}}]}}),
            ".provider.prometheus: expected a mapping",
        ),
        (
            spec_with({"analysis": {"metrics": [{k: v for k, v in METRIC.items() if k != "successCondition"}]}}),
            "needs successCondition, failureCondition or both",
        ),
        (spec_with({"analysis": {"metrics": [METRIC | {"count": 3}]}}), "count 3 needs an interval"),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"count": 0}]}}),
            ".metrics[0].count: expected a whole number >= 1",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"interval": "0s"}]}}),
            ".metrics[0].interval: must be longer than 0",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"failureLimit": -1}]}}),
            ".metrics[0].failureLimit: expected a whole number >= 0",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"count": 3, "interval": 60, "failureLimit": 3}]}}),
            "can never fail",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"noData": "success"}]}}),
            ".metrics[0].noData: expected 'inconclusive', 'error' or 'failed'",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"consecutiveSuccessLimit": 2}]}}),
            "unknown field(s) ['consecutiveSuccessLimit']",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"successCondition": "result.__class__"}]}}),
            "steps[0].analysis.metrics[0].successCondition: attribute access is not allowed",
        ),
        (
            spec_with({"analysis": {"metrics": [METRIC | {"failureCondition": 0.5}]}}),
            ".failureCondition: expected the condition as text",
        ),
    ],
)
def test_bad_specs_are_refused_naming_the_field(data: object, complaint: str) -> None:
    with pytest.raises(RolloutSpecError) as caught:
        parse_spec(data)
    assert complaint in caught.value.message


@pytest.mark.parametrize(
    ("text", "seconds"), [(30, 30.0), ("30", 30.0), ("30s", 30.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text, "d") == seconds
