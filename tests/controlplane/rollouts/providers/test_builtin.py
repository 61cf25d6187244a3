"""The built-in provider: canary against stable over the same window, from what model servers report.

Settings are checked when a rollout is created (field-named refusals); the arithmetic is checked
table-driven on windows; measurements go through the provider registry against a live control
plane whose nodes heartbeat their counters over HTTP.
"""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta
from typing import Any

import httpx
import pytest

from controlplane.persistence.rows import utcnow
from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.analysis import MeasurementPhase, judge_measurement
from controlplane.rollouts.providers import ProviderRegistry, ProviderSpecError, RolloutContext
from controlplane.rollouts.providers.builtin import BuiltinProvider, judge_window
from controlplane.rollouts.spec import AnalysisStep, parse_spec
from controlplane.state import AppState
from controlplane.traffic import Totals, Window, take_sample
from tests.controlplane.conftest import SeedVersions
from tests.controlplane.fleet_parts import register, set_pointer
from tests.controlplane.traffic_reports import Served, heartbeat, latency_le
from weightship.schemas import Role

pytestmark = pytest.mark.timeout(60)

CANARY, STABLE = "sha256:" + "c" * 64, "sha256:" + "5" * 64
WHERE = re.escape("steps[1].analysis.metrics[0].provider.builtin")
NOW = utcnow()
SINCE = "2026-12-01T06:00:00+00:00"


def provider(retention: float = 3600.0) -> BuiltinProvider:
    """A provider whose settings checks need no database."""
    return BuiltinProvider(None, stale_seconds=30.0, retention_seconds=retention)  # type: ignore[arg-type]


def spec_with(settings: dict[str, Any], **metric: Any) -> Any:
    raw = {"name": "m", "provider": {"builtin": settings}, "successCondition": "result['delta'] < 1", **metric}
    return parse_spec({"version": CANARY, "steps": [{"setWeight": 10}, {"analysis": {"metrics": [raw]}}]})


@pytest.mark.parametrize(
    ("settings", "metric", "match"),
    [
        ({}, {}, rf"{WHERE}\.metric: expected one of \['errorRate', 'latencyP50', 'latencyP99', 'requestRate', 'loadFailures', 'validation'\], got None"),
        ({"metric": "errorrate"}, {}, rf"{WHERE}\.metric: expected one of .*got 'errorrate'"),
        ({"metric": "errorRate", "minRequest": 5}, {}, rf"{WHERE}: unknown field\(s\) \['minRequest'\]"),
        ({"metric": "errorRate", "minRequests": -1}, {}, rf"{WHERE}\.minRequests: expected a whole number >= 0, got -1"),
        ({"metric": "errorRate", "minRequests": 2.5}, {}, rf"{WHERE}\.minRequests: expected a whole number"),
        ({"metric": "validation", "minRequests": 5}, {}, rf"{WHERE}\.minRequests: applies to request metrics only"),
        ({"metric": "errorRate", "window": "soon"}, {}, rf"{WHERE}\.window: expected a duration"),
        ({"metric": "errorRate", "window": "2h"}, {}, rf"{WHERE}\.window: expected 1s to 3600s \(samples are kept 3600s"),
        ({"metric": "errorRate", "window": 0}, {}, rf"{WHERE}\.window: expected 1s to"),
        ({"metric": "errorRate", "timeout": "2m"}, {}, rf"{WHERE}\.timeout: expected more than 0 and at most 60s"),
        ({"metric": "errorRate", "timeout": "20s"}, {"interval": "10s", "count": 2}, rf"{WHERE}\.timeout: 20s is longer than the metric's interval"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_field(
    settings: dict[str, Any], metric: dict[str, Any], match: str
) -> None:
    with pytest.raises(ProviderSpecError, match=match):
        ProviderRegistry.default(builtin=provider()).check_spec(spec_with(settings, **metric))


def test_good_settings_pass_and_defaults_fit_the_metric() -> None:
    ProviderRegistry.default(builtin=provider()).check_spec(spec_with({"metric": "latencyP99", "minRequests": 100}))
    assert provider().parse({"metric": "errorRate"}, "x").window_seconds == 60.0
    assert provider().parse({"metric": "errorRate"}, "x").min_requests == 1
    assert provider().parse({"metric": "validation"}, "x").window_seconds == 600.0
    assert provider().parse({"metric": "requestRate"}, "x").min_requests == 0


def totals(requests: int, errors: int = 0, seconds: float = 0.02, **more: int) -> Totals:
    return Totals(requests, errors, latency_le=tuple(latency_le([seconds] * requests)), **more)


def judged(metric: str, versions: dict[str, Totals], *, stable: str | None = STABLE, **settings: Any) -> Any:
    parsed = provider().parse({"metric": metric, **settings}, "x")
    return judge_window(parsed, Window(NOW - timedelta(seconds=60), NOW, versions), CANARY, stable)


@pytest.mark.parametrize(
    ("metric", "settings", "versions", "expected"),
    [
        ("errorRate", {}, {CANARY: totals(200, 6), STABLE: totals(800, 8)},
         {"canary": 0.03, "stable": 0.01, "delta": 0.02, "ratio": 3.0, "canary_requests": 200, "stable_requests": 800}),
        ("errorRate", {}, {CANARY: totals(100, 0), STABLE: totals(100, 0)},
         {"canary": 0.0, "stable": 0.0, "delta": 0.0, "ratio": 1.0, "canary_requests": 100, "stable_requests": 100}),
        ("latencyP50", {}, {CANARY: totals(100, seconds=0.3), STABLE: totals(100, seconds=0.02)},
         {"canary": 0.375, "stable": 0.0175, "delta": 0.3575}),
        ("latencyP99", {}, {CANARY: totals(100, seconds=0.3), STABLE: totals(100, seconds=0.02)},
         {"canary": 0.4975, "stable": 0.02485}),
        ("requestRate", {}, {CANARY: totals(60), STABLE: totals(240)},
         {"canary": 1.0, "stable": 4.0, "delta": -3.0, "ratio": 0.25}),
        ("loadFailures", {}, {CANARY: Totals(load_failures=2, validations_failed=1), STABLE: Totals()},
         {"canary": 2, "stable": 0, "delta": 2}),
        ("validation", {}, {CANARY: Totals(validations_passed=1, validations_failed=3)},
         {"canary": 0.75, "canary_failed": 3, "canary_passed": 1, "stable_failed": 0, "stable_passed": 0}),
    ],
)  # fmt: skip
def test_canary_is_compared_with_stable_over_the_same_window(
    metric: str, settings: dict[str, Any], versions: dict[str, Totals], expected: dict[str, float]
) -> None:
    result = judged(metric, versions, **settings)
    assert result is not None
    assert result["window_seconds"] == 60.0
    for key, value in expected.items():
        assert result[key] == pytest.approx(value), key


@pytest.mark.parametrize(
    ("metric", "settings", "versions", "stable"),
    [
        ("errorRate", {"minRequests": 200}, {CANARY: totals(199), STABLE: totals(5000)}, STABLE),
        ("errorRate", {"minRequests": 200}, {CANARY: totals(500), STABLE: totals(10)}, STABLE),
        ("errorRate", {}, {STABLE: totals(100)}, STABLE),  # nobody served the canary
        ("errorRate", {}, {CANARY: totals(100)}, None),  # nothing to compare with
        ("latencyP99", {}, {CANARY: Totals(requests=5), STABLE: totals(100)}, STABLE),  # no latency observed
        ("requestRate", {"minRequests": 10}, {CANARY: totals(9), STABLE: totals(100)}, STABLE),
        ("loadFailures", {}, {STABLE: Totals(load_failures=1)}, STABLE),
        ("validation", {}, {CANARY: totals(100)}, STABLE),  # no validation in the window
    ],
)  # fmt: skip
def test_too_little_traffic_is_no_data_never_success(
    metric: str, settings: dict[str, Any], versions: dict[str, Totals], stable: str | None
) -> None:
    assert judged(metric, versions, stable=stable, **settings) is None
    raw = {"name": "m", "provider": {"builtin": {"metric": metric}}, "successCondition": "result['delta'] <= 1"}
    step = parse_spec({"version": CANARY, "steps": [{"analysis": {"metrics": [raw]}}]}).steps[0]
    assert isinstance(step, AnalysisStep)
    assert judge_measurement(step.metrics[0], None, None)[0] is MeasurementPhase.INCONCLUSIVE


# --- measurements against a live control plane --------------------------------------------------------


def test_measurements_read_heartbeats_of_two_nodes_and_judge_the_canary(
    cp_client: httpx.Client, cp_state: AppState, role_headers: dict[Role, dict[str, str]], seed_versions: SeedVersions
) -> None:
    admin = role_headers[Role.admin]
    digests = seed_versions("llama")
    v1, v2 = digests["v1"], digests["v2"]
    assert cp_client.post("/v1/deployments", json={"name": "chat", "model": "llama"}, headers=admin).status_code == 201
    set_pointer(cp_client, admin, stable="v1")
    set_pointer(cp_client, admin, stable="v1", canary="v2", canary_share=0.5)
    stable_node, canary_node = (
        register(cp_client, admin, "node-s", "chat"),
        register(cp_client, admin, "node-c", "chat"),
    )
    stable, canary = Served(v1), Served(v2)
    stable.grow(1000, 0.02, errors=1)
    canary.grow(10, 0.02)
    canary.load_failures = 3
    heartbeat(cp_client, admin, stable_node, SINCE, [stable])
    heartbeat(cp_client, admin, canary_node, SINCE, [canary])
    t0 = utcnow()
    with cp_state.sessions() as session:
        take_sample(session, t0, 3600.0, 7200.0)
    stable.grow(400, 0.02, errors=2)
    canary.grow(100, 0.2, errors=5)
    canary.load_failures = 4
    heartbeat(cp_client, admin, stable_node, SINCE, [stable])
    heartbeat(cp_client, admin, canary_node, SINCE, [canary])

    builtin = BuiltinProvider(
        cp_state.sessions, stale_seconds=3600.0, retention_seconds=3600.0, clock=lambda: t0 + timedelta(seconds=60)
    )
    values = asyncio.run(measure_all(builtin, RolloutContext("r1", "chat", v2, v1)))

    errors = values["errorRate"]
    assert errors["canary"] == pytest.approx(0.05)
    assert errors["stable"] == pytest.approx(0.005)
    assert errors["delta"] == pytest.approx(0.045)
    assert (errors["canary_requests"], errors["stable_requests"]) == (100, 400)
    assert 0.1 < values["latencyP99"]["canary"] <= 0.25
    assert values["latencyP99"]["stable"] <= 0.025
    assert values["requestRate"]["canary"] == pytest.approx(100 / 60)
    assert values["loadFailures"]["canary"] == 1  # the failure counted before the window does not count
    assert values["errorRate/minRequests=101"] is None  # the canary's 100 requests in the window are too few
    assert values["validation"] is None  # no load validated in the window


async def measure_all(builtin: BuiltinProvider, context: RolloutContext) -> dict[str, Any]:
    """Each metric measured once through the registry, as a driver does."""
    wanted: dict[str, dict[str, Any]] = {
        "errorRate": {"minRequests": 100},
        "latencyP99": {},
        "requestRate": {},
        "loadFailures": {"window": "1m"},
        "errorRate/minRequests=101": {"metric": "errorRate", "minRequests": 101},
        "validation": {"window": "1m"},
    }
    values: dict[str, Any] = {}
    async with ProviderRegistry.default(builtin=builtin) as providers:
        for index, (name, settings) in enumerate(wanted.items()):
            action = MeasureMetric("run-1", name, index, "builtin", {"metric": name, **settings})
            result = await providers.measure(action, context)
            assert result.error is None, result.error
            values[name] = result.value
    return values
