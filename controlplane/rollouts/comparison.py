"""Canary versus stable over the same window, for the built-in metrics.

Absolute thresholds ("error rate below 1 %") judge a canary against a number someone guessed;
comparing it with the stable version *over the same window* judges it against what the fleet
does right now, under the same traffic mix and the same upstream incidents. The built-in provider
aggregates what model servers report per version (requests, errors, a latency histogram) into one
:class:`VersionWindow` per version and calls :func:`compare` to get the ``result`` its conditions
see::

    {"canary": 0.012, "stable": 0.010, "delta": 0.002, "ratio": 1.2}

so that ``successCondition: "result['delta'] <= 0.005"`` or ``"result['ratio'] < 1.5"`` reads
naturally. ``ratio`` is ``inf`` when stable is 0 and canary is not (and 1.0 when both are 0).

A side with fewer than ``min_requests`` requests, or a latency histogram with no observations,
gives ``None`` — *no data* — which the analysis counts as Inconclusive (or as the metric's
``noData`` policy says), never as a pass. Windows that do not match are a programming error in
the caller and raise :class:`ComparisonError`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from weightship.errors import ValidationError

__all__ = ["BUILTIN_METRICS", "ComparisonError", "VersionWindow", "compare", "histogram_quantile"]

BuiltinMetric = Literal["errorRate", "latencyP50", "latencyP99"]
BUILTIN_METRICS: tuple[BuiltinMetric, ...] = ("errorRate", "latencyP50", "latencyP99")


class ComparisonError(ValidationError):
    """Canary and stable figures that cannot be compared (different windows, unknown metric)."""


@dataclass(frozen=True)
class VersionWindow:
    """One version's built-in figures over ``[start, end)``.

    ``latency_buckets`` is a cumulative histogram in seconds, Prometheus style: ascending
    ``(upper_bound, count_at_or_below)`` pairs whose last bound is ``inf``.
    """

    version: str
    start: datetime
    end: datetime
    requests: int
    errors: int
    latency_buckets: tuple[tuple[float, int], ...] = ()

    @property
    def error_rate(self) -> float | None:
        """Errors per request, or None without requests."""
        return self.errors / self.requests if self.requests > 0 else None


def histogram_quantile(q: float, buckets: Sequence[tuple[float, int]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram by linear interpolation inside the bucket.

    Mirrors Prometheus' ``histogram_quantile``: a quantile falling in the ``+inf`` bucket returns the
    highest finite bound. None when the histogram holds no observations.
    """
    if not 0.0 <= q <= 1.0:
        raise ComparisonError(f"quantile {q} is outside 0..1")
    if not buckets or buckets[-1][1] <= 0:
        return None
    if not math.isinf(buckets[-1][0]):
        raise ComparisonError("latency histogram must end with an +inf bucket holding every observation")
    if any(later[1] < earlier[1] or later[0] <= earlier[0] for earlier, later in itertools.pairwise(buckets)):
        raise ComparisonError("latency histogram must be cumulative: bounds ascending, counts never decreasing")
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound  # pragma: no cover - the +inf bucket holds every observation


def compare(
    metric: BuiltinMetric, canary: VersionWindow, stable: VersionWindow, *, min_requests: int = 1
) -> dict[str, float] | None:
    """``{"canary", "stable", "delta", "ratio"}`` for ``metric``, or None when either side has no data."""
    if (canary.start, canary.end) != (stable.start, stable.end):
        raise ComparisonError(
            f"canary window {canary.start.isoformat()}..{canary.end.isoformat()} differs from stable window "
            f"{stable.start.isoformat()}..{stable.end.isoformat()}; compare the same window"
        )
    if canary.requests < min_requests or stable.requests < min_requests:
        return None
    if metric == "errorRate":
        pair = (canary.error_rate, stable.error_rate)
    elif metric in ("latencyP50", "latencyP99"):
        q = 0.5 if metric == "latencyP50" else 0.99
        pair = (histogram_quantile(q, canary.latency_buckets), histogram_quantile(q, stable.latency_buckets))
    else:
        raise ComparisonError(f"unknown built-in metric {metric!r}; expected one of {list(BUILTIN_METRICS)}")
    ours, theirs = pair
    if ours is None or theirs is None:
        return None
    ratio = ours / theirs if theirs > 0 else (1.0 if ours == 0 else math.inf)
    return {"canary": ours, "stable": theirs, "delta": ours - theirs, "ratio": ratio}
