"""The Prometheus provider against a real Prometheus scraping real model servers (see conftest.py)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from aiohttp import web

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.analysis import MeasurementPhase, is_no_data, judge_measurement
from controlplane.rollouts.providers import MeasurementError, PrometheusProvider, ProviderRegistry, RolloutContext
from controlplane.rollouts.spec import parse_spec
from tests.controlplane.rollouts.providers.conftest import Fleet, StubServer
from weightship.errors import TemporaryError
from weightship.testing import free_port

pytestmark = pytest.mark.timeout(240)


def requests_of(fleet: Fleet, code: str = "") -> str:
    """PromQL: request counters of the canary version's servers in this test's fleet."""
    matchers = f'test="{fleet.label}"' + (f', code="{code}"' if code else "")
    return f'weightship_serve_requests_total{{{matchers}}} and on(instance) weightship_serve_version_info{{digest="{{{{canary}}}}"}}'


def action(settings: dict[str, Any], metric: str = "m") -> MeasureMetric:
    return MeasureMetric("run-1", metric, 0, "prometheus", settings)


def context(fleet: Fleet, canary: str, **changes: str) -> RolloutContext:
    fields = {"rollout": "r-1", "deployment": "chat", "canary": canary, "stable": fleet.stable, **changes}
    return RolloutContext(**fields)


async def measure(fleet: Fleet, query: str, canary: str | None = None, **changes: str) -> list[float]:
    provider = PrometheusProvider()
    try:
        settings = {"address": fleet.prometheus.url, "query": query, "timeout": "5s"}
        return await provider.measure(action(settings), context(fleet, canary or fleet.bad, **changes))
    finally:
        await provider.aclose()


def metric_spec(success: str | None = None, failure: str | None = None) -> Any:
    conditions = {"successCondition": success} if success else {}
    if failure:
        conditions["failureCondition"] = failure
    raw = {"name": "m", "provider": {"prometheus": {}}, **conditions}
    step = parse_spec({"version": "sha256:" + "a" * 64, "steps": [{"analysis": {"metrics": [raw]}}]}).steps[0]
    return step.metrics[0]  # type: ignore[union-attr]


async def test_counter_query_returns_the_scraped_count_of_the_canary_version(fleet: Fleet) -> None:
    assert await measure(fleet, f"sum({requests_of(fleet, '400')})") == [2.0]
    assert await measure(fleet, f"sum({requests_of(fleet, '200')})") == [3.0]
    assert await measure(fleet, f"sum({requests_of(fleet, '200')})", canary=fleet.good) == [5.0]


async def test_error_rate_of_the_canary_against_a_condition(fleet: Fleet) -> None:
    rate = f"(sum({requests_of(fleet, '400')}) or vector(0)) / sum({requests_of(fleet)})"
    bad, good = await measure(fleet, rate), await measure(fleet, rate, canary=fleet.good)
    assert bad == [pytest.approx(0.4)]
    assert good == [0.0]
    metric = metric_spec(success="result[0] <= 0.05")
    assert judge_measurement(metric, bad, None)[0] is MeasurementPhase.FAILED
    assert judge_measurement(metric, good, None)[0] is MeasurementPhase.SUCCESSFUL


async def test_vector_is_one_float_per_series_in_label_order(fleet: Fleet) -> None:
    per_role = f'sum by (role) (weightship_serve_requests_total{{test="{fleet.label}"}})'
    assert await measure(fleet, per_role) == [5.0, 5.0, 4.0]  # bad, good, stable


async def test_scalar_is_a_list_of_one_float(fleet: Fleet) -> None:
    total = f'scalar(sum(weightship_serve_requests_total{{test="{fleet.label}"}}))'
    assert await measure(fleet, total) == [14.0]


async def test_empty_result_is_no_data_never_success(fleet: Fleet) -> None:
    unknown = "sha256:" + "0" * 64
    value = await measure(fleet, f"sum({requests_of(fleet)})", canary=unknown)
    assert value == []
    assert is_no_data(value)
    # Even a metric that only fails on a high value does not pass on no data.
    assert judge_measurement(metric_spec(failure="result[0] > 0.05"), value, None)[0] is MeasurementPhase.INCONCLUSIVE


async def test_nan_is_no_data(fleet: Fleet) -> None:
    none_yet = f"sum({requests_of(fleet, '500')}) or vector(0)"
    value = await measure(fleet, f"({none_yet}) / ({none_yet})")
    assert len(value) == 1
    assert math.isnan(value[0])
    assert judge_measurement(metric_spec(success="result[0] < 1"), value, None)[0] is MeasurementPhase.INCONCLUSIVE


async def test_bad_promql_is_a_permanent_error_with_prometheus_reason(fleet: Fleet) -> None:
    with pytest.raises(MeasurementError, match=r"HTTP 400: bad_data: .*parse error"):
        await measure(fleet, 'sum(weightship_serve_requests_total{code="200"')
    # Through the registry the error becomes the measurement's error text, and the analysis an Error.
    async with ProviderRegistry.default() as providers:
        bad = action({"address": fleet.prometheus.url, "query": "sum(rate(x[1m])"})
        result = await providers.measure(bad, context(fleet, fleet.bad))
    assert result.value is None
    assert result.error is not None
    assert "bad_data" in result.error
    assert (
        judge_measurement(metric_spec(success="result[0] < 1"), result.value, result.error)[0] is MeasurementPhase.ERROR
    )


async def test_range_vector_is_refused_with_a_hint(fleet: Fleet) -> None:
    with pytest.raises(MeasurementError, match=r"range vector.*rate\(\)"):
        await measure(fleet, f'weightship_serve_requests_total{{test="{fleet.label}"}}[1m]')


@pytest.mark.parametrize(
    ("deployment", "query"),
    [
        # Unescaped, the value would close the label value and add "or vector(42)" to the query.
        ('x"} or vector(42) #', 'count(weightship_serve_ready{{test="{label}", deployment="{{{{deployment}}}}"}})'),
        ("x'} or vector(42) #\\", "count(weightship_serve_ready{{test='{label}', deployment='{{{{deployment}}}}'}})"),
        # Unescaped, the regex "goo." would match the "good" role; escaped it matches only "goo.".
        ("goo.", 'count(weightship_serve_ready{{test="{label}", role=~"{{{{deployment}}}}"}})'),
        ("st.*", 'count(weightship_serve_ready{{test="{label}", role!~"{{{{deployment}}}}|bad|good"}})'),
    ],
)
async def test_placeholder_values_cannot_change_the_query(fleet: Fleet, deployment: str, query: str) -> None:
    measured = await measure(fleet, query.format(label=fleet.label), deployment=deployment)
    expected = [1.0] if "!~" in query else []  # only "stable" is neither "st.*" literally, "bad" nor "good"
    assert measured == expected


async def test_unreachable_prometheus_is_a_temporary_error(fleet: Fleet) -> None:
    provider = PrometheusProvider()
    try:
        dead = {"address": f"http://127.0.0.1:{free_port()}", "query": "vector(1)"}
        with pytest.raises(TemporaryError, match="cannot reach"):
            await provider.measure(action(dead), context(fleet, fleet.bad))
    finally:
        await provider.aclose()


async def test_prometheus_that_never_answers_times_out_as_temporary(stub: StubServer) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await stub.release.wait()  # holds the request open until the test is over
        return web.json_response({})

    stub.handler = hang
    provider = PrometheusProvider()
    started = time.monotonic()
    try:
        with pytest.raises(TemporaryError, match=r"did not answer within 0.3s"):
            await provider.measure(
                action({"address": stub.url, "query": "vector(1)", "timeout": "300ms"}),
                RolloutContext("r", "chat", "sha256:" + "a" * 64, None),
            )
    finally:
        await provider.aclose()
    assert time.monotonic() - started < 3


async def test_auth_header_comes_from_the_environment_and_the_query_is_posted(stub: StubServer) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})

    stub.handler = answer
    provider = PrometheusProvider(environ={"PROM_AUTH": "Bearer s3cret"})
    settings = {
        "address": stub.url + "/prom/",
        "query": 'up{digest="{{canary}}", stable="{{ args.stable }}"}',
        "headers": {"Authorization": {"fromEnv": "PROM_AUTH"}, "X-Scope-OrgID": "team-a"},
    }
    try:
        value = await provider.measure(action(settings), RolloutContext("r", "chat", "sha256:c", "sha256:s"))
    finally:
        await provider.aclose()
    assert value == []
    (received,) = stub.received
    assert (received.method, received.path) == ("POST", "/prom/api/v1/query")
    assert received.headers["Authorization"] == "Bearer s3cret"
    assert received.headers["X-Scope-OrgID"] == "team-a"
    assert b"up%7Bdigest%3D%22sha256%3Ac%22%2C+stable%3D%22sha256%3As%22%7D" in received.body


async def test_missing_auth_variable_is_an_error_naming_the_variable(stub: StubServer) -> None:
    provider = PrometheusProvider(environ={})
    settings = {"address": stub.url, "query": "vector(1)", "headers": {"Authorization": {"fromEnv": "PROM_AUTH"}}}
    try:
        with pytest.raises(MeasurementError, match=r"PROM_AUTH.*not set"):
            await provider.measure(action(settings), RolloutContext("r", "chat", "sha256:c", None))
    finally:
        await provider.aclose()
    assert stub.received == []


@pytest.mark.parametrize(
    ("status", "body", "error", "match"),
    [
        (503, {"status": "error", "errorType": "timeout", "error": "query timed out"}, TemporaryError, "timeout: query timed out"),
        (422, {"status": "error", "errorType": "execution", "error": "many-to-many"}, MeasurementError, "execution: many-to-many"),
        (200, {"status": "success", "data": {"resultType": "string", "result": [1, "x"]}}, MeasurementError, "string result"),
        (200, {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "zz"]}]}}, MeasurementError, "not a number"),
        (200, {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "histogram": [1, {}]}]}}, MeasurementError, "native histogram"),
        (200, {"no": "prometheus"}, MeasurementError, "not answer like a Prometheus"),
        (200, {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"i": str(i)}, "value": [1, "1"]} for i in range(101)]}}, MeasurementError, "101 series"),
    ],
)  # fmt: skip
async def test_unusable_answers_are_errors(
    stub: StubServer, status: int, body: dict[str, Any], error: type[Exception], match: str
) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    stub.handler = answer
    provider = PrometheusProvider()
    try:
        with pytest.raises(error, match=match):
            await provider.measure(action({"address": stub.url, "query": "q"}), RolloutContext("r", "d", "c", None))
    finally:
        await provider.aclose()
