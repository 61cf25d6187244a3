"""PromQL templates and field selectors: the two small languages in provider settings."""

from __future__ import annotations

import pytest

from controlplane.rollouts.providers import MeasurementError, ProviderSpecError
from controlplane.rollouts.providers.promql import parse_query
from controlplane.rollouts.providers.selector import parse_selector

VALUES = {"canary": "sha256:cc", "stable": "sha256:ss", "deployment": "chat.v2", "rollout": "r-1"}


@pytest.mark.parametrize(
    ("template", "values", "rendered"),
    [
        ('up{d="{{canary}}"}', VALUES, 'up{d="sha256:cc"}'),
        ("up{d='{{ args.stable }}'}", VALUES, "up{d='sha256:ss'}"),
        ('a{x="{{canary}}"} / b{x="{{stable}}", y="{{rollout}}"}', VALUES, 'a{x="sha256:cc"} / b{x="sha256:ss", y="r-1"}'),
        ('up{d=~"{{deployment}}"}', VALUES, r'up{d=~"chat\\.v2"}'),
        ('up{d !~ "{{deployment}}|x"}', VALUES, r'up{d !~ "chat\\.v2|x"}'),
        ('up{d="{{deployment}}"}', VALUES, 'up{d="chat.v2"}'),
        ('up{d="{{deployment}}"}', {**VALUES, "deployment": 'a"b\\c'}, r'up{d="a\"b\\c"}'),
        ("up{d='{{deployment}}'}", {**VALUES, "deployment": "a'b\"c"}, r"""up{d='a\'b"c'}"""),
        ('up{d=~"{{deployment}}"}', {**VALUES, "deployment": 'a.*"'}, r'up{d=~"a\\.\\*\""}'),
        ('up{d="a\\"{{canary}}"}', VALUES, 'up{d="a\\"sha256:cc"}'),  # an escaped quote does not end the string
        ("sum(up) # {{canary}} is not here", VALUES, None),
        ("vector(1)", VALUES, "vector(1)"),
    ],
)  # fmt: skip
def test_placeholders_render_escaped_for_their_string(
    template: str, values: dict[str, str], rendered: str | None
) -> None:
    if rendered is None:
        with pytest.raises(ProviderSpecError, match="in a comment"):
            parse_query(template, "q")
        return
    assert parse_query(template, "q").render(values) == rendered


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("up{d={{canary}}}", r"q: \{\{canary\}\} at column 6 is outside a quoted label value"),
        ('up{d="x"} + {{canary}}', r"outside a quoted label value"),
        ("up{d=`{{canary}}`}", r"raw `backtick` string cannot be escaped"),
        ('up{d="{{image}}"}', r"unknown placeholder \{\{image\}\}; available: \{\{canary\}\}"),
        ('up{d="{{canary}}}', r"the string opened with \" at column 6 is never closed"),
        ('up{d="\n"}', r"never closed"),
        ("", r"expected a PromQL query"),
        ("x" * 20_000, r"the limit is 16384"),
    ],
)
def test_unsafe_or_broken_templates_are_refused(template: str, match: str) -> None:
    with pytest.raises(ProviderSpecError, match=match):
        parse_query(template, "q")


def test_missing_stable_or_control_characters_fail_the_measurement_not_the_query() -> None:
    template = parse_query('up{a="{{stable}}", b="{{deployment}}"}', "q")
    with pytest.raises(MeasurementError, match=r"uses \{\{stable\}\} but this rollout has no stable version"):
        template.render({**VALUES, "stable": None})
    with pytest.raises(MeasurementError, match="control characters"):
        template.render({**VALUES, "deployment": "a\nb"})
    assert template.placeholders == {"stable", "deployment"}


@pytest.mark.parametrize(
    ("selector", "document", "selected"),
    [
        ("$", {"a": 1}, {"a": 1}),
        ("$.a", {"a": 1}, 1),
        ("$.a.b-c", {"a": {"b-c": [2]}}, [2]),
        ("$.a[0]", {"a": [5, 6]}, 5),
        ("$.a[-1]", {"a": [5, 6]}, 6),
        ("$['a b']['c\\'d']", {"a b": {"c'd": 7}}, 7),
        ('$["x"]', {"x": 8}, 8),
        ("$.a", [1], None),
        ("$[0]", {"0": 1}, None),
        ("$.a[2]", {"a": [1]}, None),
        ("$.a.b", {"a": "text"}, None),
        ("$[0]", "text", None),
        ("$.missing", {}, None),
    ],
)
def test_selector_selects_or_gives_none(selector: str, document: object, selected: object) -> None:
    assert parse_selector(selector, "s").select(document) == selected


@pytest.mark.parametrize(
    ("selector", "match"),
    [
        ("a.b", r"starting with '\$'"),
        ("$..a", r"column 2"),
        ("$.a[*]", r"column 4"),
        ("$.a[0:2]", r"column 4"),
        ("$[?(@.a > 1)]", r"column 2"),
        ("$.a()", r"column 4"),
        ("$" + ".a" * 33, r"more than 32 steps"),
        ("$.a['b]", r"column 4"),
        (5, r"starting with '\$'"),
    ],
)
def test_selector_beyond_the_tiny_grammar_is_refused(selector: object, match: str) -> None:
    with pytest.raises(ProviderSpecError, match=match):
        parse_selector(selector, "s")
