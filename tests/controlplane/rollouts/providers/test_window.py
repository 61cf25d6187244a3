"""``{{window}}``: the analysis step's elapsed time as a PromQL duration, allowed only outside strings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers import PrometheusProvider, ProviderSpecError, RolloutContext
from controlplane.rollouts.providers.promql import duration, parse_query

CANARY = "sha256:" + "c" * 64
CONTEXT = RolloutContext("r1", "chat", CANARY, None)


@pytest.mark.parametrize(("seconds", "text"), [(0.0, "1s"), (0.2, "1s"), (59.1, "60s"), (3600.0, "3600s")])
def test_window_renders_whole_seconds_of_at_least_one(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_window_is_written_into_a_range_selector() -> None:
    template = parse_query('sum(increase(x{digest="{{canary}}"}[{{window}}])) / {{ args.window }}', "q")
    rendered = template.render({"canary": CANARY, "window": "93s"})
    assert rendered == f'sum(increase(x{{digest="{CANARY}"}}[93s])) / 93s'


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ('x{le="{{window}}"}', "is a duration; use it outside quotes"),
        ("x[{{window}}] # {{window}}", "comment"),
        ("x[{{canary}}]", "outside a quoted label value"),
    ],
)
def test_window_inside_a_string_and_text_outside_one_are_refused(query: str, says: str) -> None:
    with pytest.raises(ProviderSpecError, match=says):
        parse_query(query, "q")


async def test_the_provider_windows_the_query_from_the_step_start_to_its_own_clock() -> None:
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(dict(httpx.QueryParams(request.content.decode()))["query"])
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "scalar", "result": [0, "1"]}})

    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    provider = PrometheusProvider(transport=httpx.MockTransport(answer), clock=lambda: now)
    settings = {"address": "http://prometheus:9090", "query": "sum(increase(x[{{window}}]))"}
    action = MeasureMetric("run", "m", 0, "prometheus", settings, step_started_at=now - timedelta(seconds=92.5))
    try:
        assert await provider.measure(action, CONTEXT) == [1.0]
    finally:
        await provider.aclose()
    assert sent == ["sum(increase(x[93s]))"]
