"""Structured logs for every component: one event name, then ``key=value`` fields.

Every line a component logs reads ``<event> key=value key=value``; values with spaces, quotes or
``=`` (anything outside a plain set of characters) are JSON-quoted, so a line always splits back
into its fields: ``parse_fields`` is the inverse of ``format_fields``. Nothing formats state into
prose, so logs stay greppable (``grep fetch.chunk_rejected``) and machine-readable.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

__all__ = ["configure", "event", "format_fields", "parse_fields"]

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-+@,")


def _value(value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    if text and all(ch in _PLAIN for ch in text):
        return text
    return json.dumps(text, ensure_ascii=False)


def format_fields(name: str, fields: dict[str, object]) -> str:
    """``name k=v ...`` with values quoted where needed."""
    parts = [name]
    parts.extend(f"{key}={_value(value)}" for key, value in fields.items())
    return " ".join(parts)


def parse_fields(line: str) -> tuple[str, dict[str, str]]:
    """The event name and fields of a ``format_fields`` line, values unquoted: its inverse.

    Raises ``ValueError`` for a line that did not come from ``format_fields``.
    """
    name, _, rest = line.partition(" ")
    if not name or "=" in name or '"' in name:
        raise ValueError(f"not a structured log line (no event name first): {line!r}")
    fields: dict[str, str] = {}
    decoder = json.JSONDecoder()
    at = 0
    while at < len(rest):
        key, eq, _ = rest[at:].partition("=")
        if not eq or not key or " " in key or '"' in key:
            raise ValueError(f"not a structured log line (expected key=value at {rest[at:]!r}): {line!r}")
        at += len(key) + 1
        if rest.startswith('"', at):
            try:
                value, at = decoder.raw_decode(rest, at)
            except json.JSONDecodeError:
                raise ValueError(f"not a structured log line (bad quoted value of {key}): {line!r}") from None
            if not isinstance(value, str):
                raise ValueError(f"not a structured log line (quoted value is not a string): {line!r}")
        else:
            end = rest.find(" ", at)
            end = len(rest) if end < 0 else end
            value = rest[at:end]
            if not value or any(ch not in _PLAIN for ch in value):
                raise ValueError(f"not a structured log line (unquoted value {value!r}): {line!r}")
            at = end
        fields[key] = value
        if at < len(rest):
            if rest[at] != " ":
                raise ValueError(f"not a structured log line (no space after {key}=): {line!r}")
            at += 1
    return name, fields


def event(logger: logging.Logger, name: str, level: int = logging.INFO, /, **fields: object) -> None:
    """Log one structured event; ``exc_info=True`` (not a field) adds the traceback of the exception being handled."""
    exc_info = bool(fields.pop("exc_info", False))
    if logger.isEnabledFor(level):
        logger.log(level, "%s", format_fields(name, fields), exc_info=exc_info)


def configure(level: str = "info", stream: TextIO | None = None, root: str = "agent") -> None:
    """Send the ``root`` logger's logs to ``stream`` (stderr) as ``time level logger event k=v``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger(root)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
