"""PromQL query templates: ``{{canary}}``-style placeholders filled in safely.

A query names the versions it judges through placeholders (Argo's ``{{args.name}}`` form is
accepted too)::

    sum(rate(weightship_serve_requests_total{code!="200", digest="{{canary}}"}[1m]))

Placeholders: ``{{canary}}``, ``{{stable}}`` (version digests), ``{{deployment}}``, ``{{rollout}}``,
and ``{{window}}``: the time since the analysis step began, as a PromQL duration in whole seconds
(``93s``, at least ``1s``), for range selectors such as ``increase(x[{{window}}])``, so a query
counts only what happened while the step ran::

    sum(increase(weightship_serve_requests_total{code=~"5.."}[{{window}}]))

Safety by construction: a text placeholder is allowed **only inside a quoted string** (a label
value), which :func:`parse_query` checks with a small PromQL lexer when the spec is read. A text
placeholder elsewhere is refused, because text pasted into the query's syntax could change what it
measures. ``{{window}}`` is the one placeholder allowed outside strings (and only there): its value
is computed here, never supplied by a user, and checked to be a duration before it is written.
When rendered, each value is escaped for the string it sits in (backslash and the quote character;
control characters are refused), and inside the string of a regex matcher (``=~``/``!~``) it is
also regex-escaped, so a deployment named ``chat.v2`` matches only itself, never ``chatxv2``.
Placeholders in raw (backtick) strings and comments are refused: neither can escape anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.rollouts.providers.base import MeasurementError, ProviderSpecError

__all__ = ["DURATION_PLACEHOLDERS", "MAX_QUERY_CHARS", "PLACEHOLDERS", "QueryTemplate", "duration", "parse_query"]

MAX_QUERY_CHARS = 16 * 1024
#: placeholders for text, allowed inside quoted label values only
PLACEHOLDERS = ("canary", "stable", "deployment", "rollout")
#: placeholders for durations, allowed outside strings only (range selectors, offsets)
DURATION_PLACEHOLDERS = ("window",)
_DURATION = re.compile(r"^[0-9]{1,12}s$")
_PLACEHOLDER = re.compile(r"\{\{\s*(?:args\.)?([A-Za-z_][A-Za-z0-9_-]*)\s*\}\}")
#: RE2 metacharacters (Prometheus matches label regexes with Go's RE2).
_RE2_SPECIAL = re.compile(r"([\\.+*?()|\[\]{}^$])")


@dataclass(frozen=True)
class _Slot:
    """Where a placeholder sits: its name, the quote of its string, and whether that is a regex."""

    name: str
    quote: str
    regex: bool


@dataclass(frozen=True)
class QueryTemplate:
    """A checked query: literal text and placeholder slots, in order."""

    text: str
    parts: tuple[str | _Slot, ...]

    @property
    def placeholders(self) -> frozenset[str]:
        """The placeholder names the query uses."""
        return frozenset(part.name for part in self.parts if isinstance(part, _Slot))

    def render(self, values: Mapping[str, str | None]) -> str:
        """The query with every placeholder replaced by its escaped value."""
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value = values.get(part.name)
            if part.quote == "":
                if value is None:
                    raise MeasurementError(
                        f"the query uses {{{{{part.name}}}}} but this measurement belongs to no analysis step; "
                        "only an analysis step's measurements have a window"
                    )
                if not _DURATION.match(value):
                    raise MeasurementError(f"{{{{{part.name}}}}} must be a duration such as 90s, got {value!r}")
                out.append(value)
                continue
            if value is None:
                raise MeasurementError(
                    f"the query uses {{{{{part.name}}}}} but this rollout has no {part.name} version; "
                    "remove it from the query or measure a rollout that has one"
                )
            if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
                raise MeasurementError(f"the value of {{{{{part.name}}}}} holds control characters; refusing to query")
            if part.regex:
                value = _RE2_SPECIAL.sub(r"\\\1", value)
            out.append(value.replace("\\", "\\\\").replace(part.quote, "\\" + part.quote))
        return "".join(out)


def parse_query(text: object, where: str) -> QueryTemplate:
    """Check a query template; raise :class:`ProviderSpecError` naming ``where`` when it is unsafe."""
    if not isinstance(text, str) or not text.strip():
        raise ProviderSpecError(f"{where}: expected a PromQL query as text, got {text!r}")
    if len(text) > MAX_QUERY_CHARS:
        raise ProviderSpecError(f"{where}: the query is {len(text)} characters; the limit is {MAX_QUERY_CHARS}")
    parts: list[str | _Slot] = []
    literal_start = 0
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in "\"'`":
            end = _string_end(text, i, where)
            if ch != "`":
                regex = _after_regex_matcher(text, i)
                for match in _PLACEHOLDER.finditer(text, i + 1, end):
                    _check_name(match, where)
                    parts.append(text[literal_start : match.start()])
                    parts.append(_Slot(match.group(1), ch, regex))
                    literal_start = match.end()
            elif _PLACEHOLDER.search(text, i + 1, end):
                raise ProviderSpecError(
                    f'{where}: a placeholder inside a raw `backtick` string cannot be escaped; use "double quotes"'
                )
            i = end + 1
            continue
        if ch == "#":
            newline = text.find("\n", i)
            end = len(text) if newline < 0 else newline
            if _PLACEHOLDER.search(text, i, end):
                raise ProviderSpecError(f"{where}: a placeholder in a comment is never used; remove it")
            i = end
            continue
        if (stray := _PLACEHOLDER.match(text, i)) is not None:
            if stray.group(1) in DURATION_PLACEHOLDERS:
                parts.append(text[literal_start:i])
                parts.append(_Slot(stray.group(1), "", False))
                literal_start = i = stray.end()
                continue
            raise ProviderSpecError(
                f"{where}: {stray.group(0)} at column {i + 1} is outside a quoted label value; placeholders "
                f'are only allowed inside quotes, e.g. {{digest="{stray.group(0)}"}}'
            )
        i += 1
    parts.append(text[literal_start:])
    return QueryTemplate(text, tuple(part for part in parts if part != ""))


def _string_end(text: str, start: int, where: str) -> int:
    """Index of the quote closing the string that opens at ``start``."""
    quote = text[start]
    i = start + 1
    while i < len(text):
        if text[i] == "\\" and quote != "`":
            i += 2
            continue
        if text[i] == quote:
            return i
        if text[i] == "\n" and quote != "`":
            break
        i += 1
    raise ProviderSpecError(f"{where}: the string opened with {quote} at column {start + 1} is never closed")


def _after_regex_matcher(text: str, position: int) -> bool:
    """Whether the string at ``position`` is the right side of ``=~`` or ``!~``."""
    j = position - 1
    while j >= 0 and text[j].isspace():
        j -= 1
    return j >= 1 and text[j] == "~" and text[j - 1] in "=!"


def duration(seconds: float) -> str:
    """A PromQL duration of at least one second covering ``seconds``: ``93s``."""
    return f"{max(1, math.ceil(seconds))}s"


def _check_name(match: re.Match[str], where: str) -> None:
    if match.group(1) in DURATION_PLACEHOLDERS:
        raise ProviderSpecError(
            f"{where}: {match.group(0)} is a duration; use it outside quotes, in a range selector: "
            f"increase(x[{match.group(0)}])"
        )
    if match.group(1) not in PLACEHOLDERS:
        raise ProviderSpecError(
            f"{where}: unknown placeholder {match.group(0)}; available: "
            + ", ".join(f"{{{{{name}}}}}" for name in (*PLACEHOLDERS, *DURATION_PLACEHOLDERS))
        )
