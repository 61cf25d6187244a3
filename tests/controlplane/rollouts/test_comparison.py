"""Canary against stable over the same window, and the default progress deadline."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from controlplane.rollouts.comparison import ComparisonError, VersionWindow, compare, histogram_quantile
from controlplane.rollouts.conditions import compile_condition
from controlplane.rollouts.deadline import progress_deadline
from tests.controlplane.rollouts.simulation import CANARY, STABLE, T0

pytestmark = pytest.mark.timeout(10)

END = T0 + timedelta(minutes=5)
INF = math.inf


def window(version: str, requests: int, errors: int, buckets: tuple[tuple[float, int], ...] = ()) -> VersionWindow:
    return VersionWindow(version, T0, END, requests, errors, buckets)


def test_error_rate_comparison_feeds_a_relative_condition() -> None:
    result = compare("errorRate", window(CANARY, 1000, 30), window(STABLE, 9000, 90))
    assert result == pytest.approx({"canary": 0.03, "stable": 0.01, "delta": 0.02, "ratio": 3.0})
    assert compile_condition("result['delta'] <= 0.005").evaluate(result) is False


@pytest.mark.parametrize(
    ("canary", "stable", "ratio"),
    [(window(CANARY, 100, 0), window(STABLE, 100, 0), 1.0), (window(CANARY, 100, 1), window(STABLE, 100, 0), INF)],
)
def test_ratio_against_a_clean_stable(canary: VersionWindow, stable: VersionWindow, ratio: float) -> None:
    result = compare("errorRate", canary, stable)
    assert result is not None
    assert result["ratio"] == ratio


def test_too_little_traffic_is_no_data_not_a_pass() -> None:
    assert compare("errorRate", window(CANARY, 3, 0), window(STABLE, 5000, 1), min_requests=50) is None
    assert compare("latencyP99", window(CANARY, 10, 0), window(STABLE, 10, 0)) is None  # no histogram


def test_windows_must_match() -> None:
    shifted = VersionWindow(STABLE, T0 - timedelta(minutes=1), END, 10, 0)
    with pytest.raises(ComparisonError, match="compare the same window"):
        compare("errorRate", window(CANARY, 10, 0), shifted)


def test_p99_latency_comparison_interpolates_like_prometheus() -> None:
    canary = window(CANARY, 100, 0, ((0.1, 50), (0.5, 90), (1.0, 100), (INF, 100)))
    stable = window(STABLE, 100, 0, ((0.1, 80), (0.5, 99), (1.0, 100), (INF, 100)))
    result = compare("latencyP99", canary, stable)
    assert result is not None
    assert result["canary"] == pytest.approx(0.95)  # rank 99 in (0.5, 1.0] holding 90..100
    assert result["stable"] == pytest.approx(0.5)
    assert compare("latencyP50", canary, stable) == pytest.approx(
        {"canary": 0.1, "stable": 0.0625, "delta": 0.0375, "ratio": 1.6}
    )


@pytest.mark.parametrize(
    ("buckets", "expected"),
    [
        ((), None),
        (((1.0, 0), (INF, 0)), None),
        (((1.0, 10), (INF, 20)), 1.0),  # in the +inf bucket: the highest finite bound
        (((1.0, 100), (INF, 100)), 0.99),
    ],
)
def test_histogram_quantile_edges(buckets: tuple[tuple[float, int], ...], expected: float | None) -> None:
    assert histogram_quantile(0.99, buckets) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(
    ("buckets", "complaint"), [(((1.0, 5), (2.0, 9)), r"\+inf bucket"), (((1.0, 5), (2.0, 3), (INF, 9)), "cumulative")]
)
def test_malformed_histograms_are_refused(buckets: tuple[tuple[float, int], ...], complaint: str) -> None:
    with pytest.raises(ComparisonError, match=complaint):
        histogram_quantile(0.5, buckets)


GB, MB = 10**9, 10**6


@pytest.mark.parametrize(
    ("spec_seconds", "size", "rate", "seconds", "basis"),
    [
        (None, 2 * GB, 500 * MB, 600.0, "measured"),  # small model: Argo's 600 s stays the floor
        (None, 140 * GB, 500 * MB, 860.0, "measured"),  # 2 * 280 s + 300 s
        (None, 140 * GB, 100 * MB, 3100.0, "measured"),  # a slower fleet gets longer
        (None, 140 * GB, None, 2 * 140 * GB / (50 * 1024 * 1024) + 300, "assumed"),
        (None, 140 * GB, 0.0, 2 * 140 * GB / (50 * 1024 * 1024) + 300, "assumed"),
        (None, 10 * GB, 10.0, 2 * 10 * GB / (1024 * 1024) + 300, "measured"),  # a stalled fleet is bounded
        (1200.0, 140 * GB, 1 * MB, 1200.0, "from the spec"),
    ],
)
def test_default_progress_deadline_is_sized_from_bytes_and_fetch_rate(
    spec_seconds: float | None, size: int, rate: float | None, seconds: float, basis: str
) -> None:
    deadline = progress_deadline(spec_seconds, size, rate)
    assert deadline.seconds == pytest.approx(seconds, abs=0.01)
    assert basis in deadline.basis
