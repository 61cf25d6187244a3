"""Structured log lines: one event name followed by ``key=value`` fields."""

from __future__ import annotations

import logging

__all__ = ["log_event"]


def _value(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return repr(text) if (" " in text or "=" in text or not text) else text


def log_event(logger: logging.Logger, level: int, event: str, **fields: object) -> None:
    """Log ``event`` with its fields as ``event key=value ...`` (values with spaces are quoted)."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s %s", event, " ".join(f"{k}={_value(v)}" for k, v in fields.items()))
