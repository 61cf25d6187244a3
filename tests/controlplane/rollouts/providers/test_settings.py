"""Provider settings are checked when a rollout is created; every refusal names the exact field."""

from __future__ import annotations

import re
from typing import Any

import pytest

from controlplane.rollouts.providers import ProviderRegistry, ProviderSpecError
from controlplane.rollouts.providers.endpoint import Header
from controlplane.rollouts.spec import RolloutSpecError, parse_spec

VERSION = "sha256:" + "a" * 64
WHERE = re.escape("steps[1].analysis.metrics[0].provider")


def spec_with(provider: dict[str, Any], **metric: Any) -> Any:
    raw = {"name": "m", "provider": provider, "successCondition": "result[0] < 1", **metric}
    return parse_spec({"version": VERSION, "steps": [{"setWeight": 10}, {"analysis": {"metrics": [raw]}}]})


def check(provider: dict[str, Any], **metric: Any) -> None:
    ProviderRegistry.default().check_spec(spec_with(provider, **metric))


PROM = {"address": "http://prometheus:9090", "query": 'sum(up{digest="{{canary}}"})'}
HOOK = {"url": "https://hooks.internal/judge"}


@pytest.mark.parametrize(
    ("provider", "metric", "match"),
    [
        ({"prometheus": {**PROM, "adress": "x"}}, {}, rf"{WHERE}\.prometheus: unknown field\(s\) \['adress'\]"),
        ({"prometheus": {"query": "up"}}, {}, rf"{WHERE}\.prometheus\.address: required"),
        ({"prometheus": {"address": "http://p:9090"}}, {}, rf"{WHERE}\.prometheus\.query: required"),
        ({"prometheus": {**PROM, "address": "ftp://p"}}, {}, rf"{WHERE}\.prometheus\.address: expected an http"),
        ({"prometheus": {**PROM, "address": "http://u:pw@p:9090"}}, {}, r"address: credentials in the URL"),
        ({"prometheus": {**PROM, "address": "http://p:9090/#x"}}, {}, r"address: a URL fragment"),
        ({"prometheus": {**PROM, "query": ""}}, {}, r"prometheus\.query: expected a PromQL query"),
        ({"prometheus": {**PROM, "query": "up{digest={{canary}}}"}}, {}, r"query: \{\{canary\}\} at column 11 is outside a quoted"),
        ({"prometheus": {**PROM, "query": 'up{d="{{canry}}"}'}}, {}, r"query: unknown placeholder \{\{canry\}\}"),
        ({"prometheus": {**PROM, "timeout": "2m"}}, {}, r"prometheus\.timeout: expected more than 0 and at most 60s"),
        ({"prometheus": {**PROM, "timeout": "soon"}}, {}, r"prometheus\.timeout: expected a duration"),
        ({"prometheus": {**PROM, "timeout": "20s"}}, {"interval": "15s", "count": 2}, r"prometheus\.timeout: 20s is longer than the metric's interval 15s"),
        ({"prometheus": {**PROM, "headers": {"Host": "x"}}}, {}, r"headers\.Host: the provider sets this header itself"),
        ({"prometheus": {**PROM, "headers": {"Bad Name": "x"}}}, {}, r"headers: 'Bad Name' is not a valid HTTP header name"),
        ({"prometheus": {**PROM, "headers": {"X-A": "a\r\nX-B: b"}}}, {}, r"headers\.X-A: a header value must be one line"),
        ({"prometheus": {**PROM, "headers": {"X-A": {"fromEnv": "1X"}}}}, {}, r"headers\.X-A\.fromEnv: expected an environment variable name"),
        ({"prometheus": {**PROM, "headers": {"X-A": {"fromSecret": "x"}}}}, {}, r"headers\.X-A: expected a string or \{fromEnv: VARIABLE\}"),
        ({"prometheus": {**PROM, "headers": ["X-A"]}}, {}, r"headers: expected a mapping"),
        ({"webhook": {}}, {}, rf"{WHERE}\.webhook\.url: required"),
        ({"webhook": {**HOOK, "method": "GET"}}, {}, r"webhook: unknown field\(s\) \['method'\]"),
        ({"webhook": {**HOOK, "jsonPath": "result"}}, {}, r"webhook\.jsonPath: expected a field selector starting with '\$'"),
        ({"webhook": {**HOOK, "jsonPath": "$.a[*]"}}, {}, r"webhook\.jsonPath: cannot read '\$\.a\[\*\]' at column 4"),
        ({"webhook": {**HOOK, "timeout": 0}}, {}, r"webhook\.timeout: expected more than 0"),
        ({"builtin": {"metric": "errorRate"}}, {}, rf"{WHERE}\.builtin: this control plane has no 'builtin' provider"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_field(
    provider: dict[str, Any], metric: dict[str, Any], match: str
) -> None:
    with pytest.raises(ProviderSpecError, match=match):
        check(provider, **metric)


def test_provider_spec_errors_are_rollout_spec_errors() -> None:
    # Callers that already turn a RolloutSpecError into a 400 need nothing new.
    with pytest.raises(RolloutSpecError):
        check({"webhook": {}})


@pytest.mark.parametrize(
    "provider",
    [
        {"prometheus": PROM},
        {"prometheus": {**PROM, "timeout": "9s", "headers": {"Authorization": {"fromEnv": "PROM_AUTH"}, "X-Org": "a"}}},
        {"prometheus": {"address": "https://p.example/prometheus/", "query": "vector(1) # {{ not a placeholder"}},
        {"webhook": {**HOOK, "jsonPath": "$.metrics['error-rate'].canary", "timeout": 5}},
    ],
)
def test_good_settings_are_accepted(provider: dict[str, Any]) -> None:
    check(provider, interval="10s", count=3)


def test_literal_header_values_never_show_in_repr() -> None:
    assert "s3cret" not in repr(Header("Authorization", value="Bearer s3cret"))
    assert "fromEnv=TOKEN" in repr(Header("Authorization", from_env="TOKEN"))
