"""Structured log lines: every value that can hold spaces, quotes or ``=`` is quoted, and a line parses back."""

from __future__ import annotations

import pytest

from weightship.logs import format_fields, parse_fields

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"deployment": "chat", "epoch": 7},
        {"error": 'S3 answered 503 SlowDown: "slow down" = back off'},
        {"empty": "", "none": None, "flag": True},
        {"path": "/v1/nodes/n-1/heartbeat", "selector": "zone=a,rack=b"},
        {"unicode": "é ✓", "lines": "one\ntwo"},
    ],
    ids=["none", "plain", "spaces-quotes-equals", "empty-none-bool", "path-and-equals", "unicode-newline"],
)
def test_a_formatted_line_parses_back_into_its_fields(fields: dict[str, object]) -> None:
    line = format_fields("area.happened", fields)
    assert "\n" not in line
    assert parse_fields(line) == ("area.happened", {key: str(value) for key, value in fields.items()})


@pytest.mark.parametrize("line", ["", "key=value first", "ev error=two words", 'ev k="unterminated', "ev k=v  j=w"])
def test_a_line_not_written_by_format_fields_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="not a structured log line"):
        parse_fields(line)
