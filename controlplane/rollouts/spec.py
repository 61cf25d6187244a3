"""The rollout spec: what an operator asks for, read from plain JSON/YAML data and checked once.

A spec names the version to roll out and the steps to take (keys follow Argo Rollouts' casing so
that a ``ModelRollout`` manifest reads like an Argo one)::

    {"version": "sha256:…",
     "progressDeadlineSeconds": 3600,          # optional; sized from bytes and fetch rate if absent
     "steps": [{"prefetch": {"percent": 100}},
               {"setWeight": 10},
               {"analysis": {"metrics": [{"name": "error-rate", "interval": "1m", "count": 5,
                                          "successCondition": "result['canary'] <= 0.01",
                                          "provider": {"builtin": {"metric": "errorRate"}}}]}},
               {"pause": {"duration": "10m"}},
               {"setWeight": 50},
               {"pause": {}}]}

:func:`parse_spec` turns that into frozen dataclasses or raises :class:`RolloutSpecError` whose
message names the exact field (``steps[2].analysis.metrics[0].count``), what is wrong and what is
accepted. Unknown keys are refused, so a typo never silently changes behaviour. The parsed spec
has a :attr:`RolloutSpec.fingerprint`: the status remembers it, and a different fingerprint means
"the spec changed", which restarts the rollout from its first step.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from controlplane.rollouts.conditions import Condition, ConditionError, compile_condition
from weightship.errors import ValidationError

__all__ = [
    "AnalysisStep",
    "MetricSpec",
    "NoDataPolicy",
    "PauseStep",
    "PrefetchStep",
    "RolloutSpec",
    "RolloutSpecError",
    "SetWeightStep",
    "Step",
    "parse_duration",
    "parse_spec",
]

NoDataPolicy = Literal["inconclusive", "error", "failed"]

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_METRIC_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
PROVIDER_KINDS = ("builtin", "prometheus", "webhook")


class RolloutSpecError(ValidationError):
    """The rollout spec is malformed; the message names the field and what it accepts."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric of an analysis step, with Argo's limits (see ``analysis.py`` for the arithmetic)."""

    name: str
    provider_kind: str
    provider: Mapping[str, Any]
    success: Condition | None
    failure: Condition | None
    count: int
    interval_seconds: float | None
    initial_delay_seconds: float = 0.0
    failure_limit: int = 0
    inconclusive_limit: int = 0
    consecutive_error_limit: int = 4
    no_data: NoDataPolicy = "inconclusive"


@dataclass(frozen=True)
class SetWeightStep:
    """Send ``weight`` percent of traffic to the canary; done once the fleet serves it."""

    weight: int


@dataclass(frozen=True)
class PauseStep:
    """Wait ``duration_seconds``, or until promoted when the duration is None."""

    duration_seconds: float | None


@dataclass(frozen=True)
class AnalysisStep:
    """Measure ``metrics`` and continue on Successful, pause on Inconclusive, abort on Failed/Error."""

    metrics: tuple[MetricSpec, ...]


@dataclass(frozen=True)
class PrefetchStep:
    """Wait until the canary is staged and verified on ``percent`` of the target nodes."""

    percent: int


Step = SetWeightStep | PauseStep | AnalysisStep | PrefetchStep


@dataclass(frozen=True)
class RolloutSpec:
    """A checked rollout spec; build it with :func:`parse_spec`."""

    version: str
    steps: tuple[Step, ...]
    progress_deadline_seconds: float | None = None
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fingerprint(self) -> str:
        """Digest of the spec's canonical JSON: equal specs, equal fingerprints."""
        canonical = json.dumps(self.source, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def prefetch_percent(self) -> int:
        """The largest share any prefetch step waits for (0 when there is none)."""
        return max((s.percent for s in self.steps if isinstance(s, PrefetchStep)), default=0)


def parse_spec(data: object) -> RolloutSpec:
    """Check ``data`` (decoded JSON/YAML) and return the spec, or raise :class:`RolloutSpecError`."""
    spec = _mapping(data, "spec", {"version", "steps", "progressDeadlineSeconds"})
    version = spec.get("version")
    if not isinstance(version, str) or not _DIGEST.match(version):
        raise RolloutSpecError(f"spec.version: expected a version digest 'sha256:<64 hex>', got {version!r}")
    deadline = spec.get("progressDeadlineSeconds")
    if deadline is not None:
        deadline = _number(deadline, "spec.progressDeadlineSeconds", minimum=1)
    raw_steps = spec.get("steps", [])
    if not isinstance(raw_steps, list):
        raise RolloutSpecError(f"spec.steps: expected a list of steps, got {type(raw_steps).__name__}")
    steps = tuple(_step(raw, f"steps[{i}]") for i, raw in enumerate(raw_steps))
    return RolloutSpec(version=version, steps=steps, progress_deadline_seconds=deadline, source=dict(spec))


def parse_duration(value: object, where: str) -> float:
    """Seconds from ``30``, ``"30s"``, ``"5m"``, ``"1.5h"`` or ``"250ms"``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number(value, where, minimum=0)
    if isinstance(value, str) and (match := _DURATION.match(value.strip())):
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    raise RolloutSpecError(f"{where}: expected a duration such as 30, '30s', '5m' or '1h', got {value!r}")


def _mapping(data: object, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise RolloutSpecError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - allowed)
    if unknown:
        raise RolloutSpecError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    return data


def _number(value: object, where: str, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < minimum:
        raise RolloutSpecError(f"{where}: expected a number >= {minimum:g}, got {value!r}")
    return float(value)


def _integer(value: object, where: str, *, minimum: int, maximum: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise RolloutSpecError(f"{where}: expected a whole number {bound}, got {value!r}")
    return value


def _step(raw: object, where: str) -> Step:
    kinds = {"setWeight", "pause", "analysis", "prefetch"}
    if not isinstance(raw, Mapping) or len(raw) != 1:
        raise RolloutSpecError(f"{where}: a step is a mapping with exactly one of {sorted(kinds)}, got {raw!r}")
    ((kind, body),) = raw.items()
    if kind == "setWeight":
        return SetWeightStep(weight=_integer(body, f"{where}.setWeight", minimum=0, maximum=100))
    if kind == "pause":
        pause = _mapping(body, f"{where}.pause", {"duration"})
        duration = pause.get("duration")
        return PauseStep(None if duration is None else parse_duration(duration, f"{where}.pause.duration"))
    if kind == "prefetch":
        prefetch = _mapping(body, f"{where}.prefetch", {"percent"})
        return PrefetchStep(_integer(prefetch.get("percent", 100), f"{where}.prefetch.percent", minimum=1, maximum=100))
    if kind == "analysis":
        analysis = _mapping(body, f"{where}.analysis", {"metrics"})
        metrics = analysis.get("metrics")
        if not isinstance(metrics, list) or not metrics:
            raise RolloutSpecError(f"{where}.analysis.metrics: expected a non-empty list of metrics")
        parsed = tuple(_metric(m, f"{where}.analysis.metrics[{i}]") for i, m in enumerate(metrics))
        names = [m.name for m in parsed]
        if len(set(names)) != len(names):
            raise RolloutSpecError(f"{where}.analysis.metrics: metric names must be unique, got {names}")
        return AnalysisStep(parsed)
    raise RolloutSpecError(f"{where}: unknown step kind {kind!r}; expected one of {sorted(kinds)}")


def _metric(raw: object, where: str) -> MetricSpec:
    fields = {
        "name", "provider", "successCondition", "failureCondition", "interval", "count", "initialDelay",
        "failureLimit", "inconclusiveLimit", "consecutiveErrorLimit", "noData",
    }  # fmt: skip
    metric = _mapping(raw, where, fields)
    name = metric.get("name")
    if not isinstance(name, str) or not _METRIC_NAME.match(name):
        raise RolloutSpecError(f"{where}.name: expected a lowercase name like 'error-rate', got {name!r}")
    provider = metric.get("provider")
    if not isinstance(provider, Mapping) or len(provider) != 1 or next(iter(provider)) not in PROVIDER_KINDS:
        raise RolloutSpecError(f"{where}.provider: expected exactly one of {list(PROVIDER_KINDS)}, got {provider!r}")
    ((kind, settings),) = provider.items()
    if not isinstance(settings, Mapping):
        raise RolloutSpecError(f"{where}.provider.{kind}: expected a mapping of provider settings")
    success = _condition(metric.get("successCondition"), f"{where}.successCondition")
    failure = _condition(metric.get("failureCondition"), f"{where}.failureCondition")
    if success is None and failure is None:
        # Argo's code counts such a metric as Successful and its docs as Inconclusive; we refuse it.
        raise RolloutSpecError(f"{where}: a metric needs successCondition, failureCondition or both")
    interval = metric.get("interval")
    interval_seconds = None if interval is None else parse_duration(interval, f"{where}.interval")
    if interval_seconds is not None and interval_seconds <= 0:
        raise RolloutSpecError(f"{where}.interval: must be longer than 0 seconds")
    count = _integer(metric.get("count", 1), f"{where}.count", minimum=1)
    if count > 1 and interval_seconds is None:
        raise RolloutSpecError(f"{where}: count {count} needs an interval between measurements (e.g. interval: '1m')")
    failure_limit = _integer(metric.get("failureLimit", 0), f"{where}.failureLimit", minimum=0)
    if failure_limit >= count:
        raise RolloutSpecError(
            f"{where}.failureLimit: {failure_limit} failures allowed out of {count} measurements means this "
            f"metric can never fail; use a failureLimit below count"
        )
    no_data = metric.get("noData", "inconclusive")
    if no_data not in ("inconclusive", "error", "failed"):
        raise RolloutSpecError(f"{where}.noData: expected 'inconclusive', 'error' or 'failed', got {no_data!r}")
    return MetricSpec(
        name=name,
        provider_kind=kind,
        provider=dict(settings),
        success=success,
        failure=failure,
        count=count,
        interval_seconds=interval_seconds,
        initial_delay_seconds=parse_duration(metric.get("initialDelay", 0), f"{where}.initialDelay"),
        failure_limit=failure_limit,
        inconclusive_limit=_integer(metric.get("inconclusiveLimit", 0), f"{where}.inconclusiveLimit", minimum=0),
        consecutive_error_limit=_integer(
            metric.get("consecutiveErrorLimit", 4), f"{where}.consecutiveErrorLimit", minimum=0
        ),
        no_data=no_data,
    )


def _condition(text: object, where: str) -> Condition | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise RolloutSpecError(f"{where}: expected the condition as text, got {type(text).__name__}")
    try:
        return compile_condition(text, where=where)
    except ConditionError as exc:
        raise RolloutSpecError(exc.message) from None
