"""The built-in provider: judge the canary against the stable version on what the model servers report.

Settings (``provider: {builtin: {...}}``)::

    metric: errorRate        # errorRate | latencyP50 | latencyP99 | requestRate | loadFailures | validation
    minRequests: 200         # request metrics only: fewer on either side (canary for requestRate) is no data
    window: 1m               # the window both versions are measured over; default 1m (10m for
                             # loadFailures and validation, which happen only when a version loads)
    timeout: 5s

Each measurement reads the counters the fleet's model servers reported through their agents
(``controlplane.traffic``): the difference between now and the sample at the window's start, summed
over the live nodes, per version. Canary and stable are measured over the *same* window.

``result`` by metric:

- ``errorRate``, ``latencyP50``, ``latencyP99`` (seconds): ``{"canary", "stable", "delta", "ratio",
  "canary_requests", "stable_requests", "window_seconds"}`` (``comparison.compare``);
- ``requestRate`` (requests per second): the same keys;
- ``loadFailures``: ``{"canary", "stable", "delta", "window_seconds"}``, failed loads (start-up
  failures) in the window;
- ``validation``: ``{"canary", "canary_failed", "canary_passed", "stable_failed", "stable_passed",
  "window_seconds"}``, ``canary`` being the share of the canary's validations that failed.

**No data** (``None``: Inconclusive by default, never success): fewer than ``minRequests`` requests,
no stable version to compare with (request metrics), no node reporting the canary in the window
(``loadFailures``), no validation of the canary in the window (``validation``), or samples not yet
covering half the window (a control plane that just started).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, get_args

from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import utcnow
from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.comparison import VersionWindow, compare
from controlplane.rollouts.providers.base import ProviderSpecError, RolloutContext
from controlplane.rollouts.providers.endpoint import parse_timeout
from controlplane.rollouts.spec import RolloutSpecError, parse_duration
from controlplane.state import AppState
from controlplane.traffic import Totals, Window, window
from weightship.errors import TemporaryError

__all__ = ["BUILTIN_METRICS", "BuiltinProvider", "BuiltinSettings"]

Metric = Literal["errorRate", "latencyP50", "latencyP99", "requestRate", "loadFailures", "validation"]
BUILTIN_METRICS: tuple[Metric, ...] = get_args(Metric)
_REQUEST_METRICS = frozenset({"errorRate", "latencyP50", "latencyP99", "requestRate"})
_MAX_WINDOW_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class BuiltinSettings:
    """Checked settings of one built-in metric."""

    metric: Metric
    window_seconds: float
    min_requests: int
    timeout_seconds: float


class BuiltinProvider:
    """Measures from the serving counters in the control plane's database (``controlplane.traffic``)."""

    kind = "builtin"
    fields = frozenset({"metric", "minRequests", "window", "timeout"})

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        stale_seconds: float,
        retention_seconds: float,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._sessions = sessions
        self._stale_seconds = stale_seconds
        self._retention_seconds = retention_seconds
        self._clock = clock

    def parse(self, raw: Mapping[str, Any], where: str) -> BuiltinSettings:
        """Check ``raw``; every error names ``where`` + the field and what it accepts."""
        if not isinstance(raw, Mapping):
            raise ProviderSpecError(f"{where}: expected a mapping of settings, got {type(raw).__name__}")
        unknown = sorted(set(map(str, raw)) - self.fields)
        if unknown:
            raise ProviderSpecError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(self.fields)}")
        metric = raw.get("metric")
        if metric not in BUILTIN_METRICS:
            raise ProviderSpecError(f"{where}.metric: expected one of {list(BUILTIN_METRICS)}, got {metric!r}")
        requests = metric in _REQUEST_METRICS
        min_requests = raw.get("minRequests", 1 if metric in ("errorRate", "latencyP50", "latencyP99") else 0)
        if "minRequests" in raw and not requests:
            raise ProviderSpecError(
                f"{where}.minRequests: applies to request metrics only, not to {metric!r}; remove it"
            )
        if isinstance(min_requests, bool) or not isinstance(min_requests, int) or min_requests < 0:
            raise ProviderSpecError(f"{where}.minRequests: expected a whole number >= 0, got {min_requests!r}")
        default_window = 60.0 if requests else 600.0
        try:
            seconds = parse_duration(raw.get("window", default_window), f"{where}.window")
        except RolloutSpecError as exc:
            raise ProviderSpecError(exc.message) from None
        limit = min(_MAX_WINDOW_SECONDS, self._retention_seconds)
        if not 1.0 <= seconds <= limit:
            raise ProviderSpecError(
                f"{where}.window: expected 1s to {limit:g}s (samples are kept {self._retention_seconds:g}s; "
                f"WEIGHTSHIP_SERVE_SAMPLE_RETENTION_SECONDS raises that), got {raw.get('window')!r}"
            )
        timeout = parse_timeout(raw.get("timeout", 5.0), f"{where}.timeout")
        return BuiltinSettings(metric, seconds, min_requests, timeout)

    @classmethod
    def for_state(cls, state: AppState) -> BuiltinProvider:
        """The provider reading ``state``'s database with its settings' staleness and sample retention."""
        return cls(
            state.sessions,
            stale_seconds=state.settings.node_stale_seconds,
            retention_seconds=state.settings.serve_sample_retention_seconds,
        )

    async def measure(self, action: MeasureMetric, context: RolloutContext) -> object:
        """One measurement of the canary against the stable version over the same window."""
        settings = self.parse(action.provider, f"metric {action.metric!r}")
        now = self._clock()
        try:
            found = await asyncio.wait_for(
                asyncio.to_thread(self._window, context.deployment, settings.window_seconds, now),
                settings.timeout_seconds,
            )
        except TimeoutError:
            raise TemporaryError(
                f"reading serving counters of deployment {context.deployment!r} took over "
                f"{settings.timeout_seconds:g}s; the database is busy"
            ) from None
        if found is None:
            return None
        return judge_window(settings, found, context.canary, context.stable)

    def _window(self, deployment: str, seconds: float, now: datetime) -> Window | None:
        with database_errors("reading serving counters"), self._sessions() as session:
            return window(session, deployment, seconds, now, self._stale_seconds)

    async def aclose(self) -> None:
        """Nothing to release: the sessions belong to the control plane."""


def judge_window(settings: BuiltinSettings, found: Window, canary: str, stable: str | None) -> dict[str, float] | None:
    """The ``result`` of ``settings.metric`` for ``canary`` against ``stable`` in ``found``, or None (no data)."""
    ours = found.versions.get(canary)
    theirs = found.versions.get(stable) if stable is not None else None
    seconds = found.seconds
    if settings.metric == "loadFailures":
        if ours is None:
            return None
        stable_failures = theirs.load_failures if theirs is not None else 0
        return {
            "canary": ours.load_failures,
            "stable": stable_failures,
            "delta": ours.load_failures - stable_failures,
            "window_seconds": seconds,
        }
    if settings.metric == "validation":
        if ours is None or ours.validations_passed + ours.validations_failed == 0:
            return None
        theirs = theirs or Totals()
        return {
            "canary": ours.validations_failed / (ours.validations_passed + ours.validations_failed),
            "canary_failed": ours.validations_failed,
            "canary_passed": ours.validations_passed,
            "stable_failed": theirs.validations_failed,
            "stable_passed": theirs.validations_passed,
            "window_seconds": seconds,
        }
    if stable is None or seconds <= 0:
        return None
    ours, theirs = ours or Totals(), theirs or Totals()
    if settings.metric == "requestRate":
        if ours.requests < settings.min_requests:
            return None
        rate, stable_rate = ours.requests / seconds, theirs.requests / seconds
        ratio = rate / stable_rate if stable_rate > 0 else (1.0 if rate == 0 else math.inf)
        result: dict[str, float] | None = {
            "canary": rate,
            "stable": stable_rate,
            "delta": rate - stable_rate,
            "ratio": ratio,
        }
    else:
        windows = [
            VersionWindow(digest, found.start, found.end, t.requests, t.errors, t.latency_buckets())
            for digest, t in ((canary, ours), (stable, theirs))
        ]
        result = compare(settings.metric, windows[0], windows[1], min_requests=max(1, settings.min_requests))
    if result is None:
        return None
    return {**result, "canary_requests": ours.requests, "stable_requests": theirs.requests, "window_seconds": seconds}
