"""Structured logs for every component: one event name, then ``key=value`` fields.

Every line the agent logs reads ``<event> key=value key=value``; values with spaces, quotes or
``=`` are JSON-quoted so a line always splits back into its fields. Nothing formats state into
prose, so logs stay greppable (``grep fetch.chunk_rejected``) and machine-readable.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

__all__ = ["configure", "event", "format_fields"]

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


def event(logger: logging.Logger, name: str, level: int = logging.INFO, /, **fields: object) -> None:
    """Log one structured event."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s", format_fields(name, fields))


def configure(level: str = "info", stream: TextIO | None = None, root: str = "agent") -> None:
    """Send the ``root`` logger's logs to ``stream`` (stderr) as ``time level logger event k=v``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger(root)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
