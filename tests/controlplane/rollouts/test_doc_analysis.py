"""The Prometheus analysis examples in docs/rollouts.md, run against a real Prometheus.

The examples are read out of the doc (``tests.prometheus_examples.doc_metrics``), so the doc cannot
drift from what is tested. Prometheus scrapes one metrics endpoint per model server, each exposing
``gpu_loader.metrics.ServeMetrics`` (the very families ``weightship-serve`` registers), driven the
way ``gpu_loader.serve`` drives them: a load that passes sets ``weightship_serve_validation_passed``
to 1 and ``weightship_serve_version_info`` for the new digest (removing the old one); a refused
version sets validation to 0 and the server keeps serving the previous version; every request counts
by status code into ``weightship_serve_requests_total`` and the latency histogram.

Canaries: healthy; one that refuses its version; one that answers 5xx; one that is slow; one that
answered 503 while it was still loading, before the step began (must pass: the window is the
step's); one that never loaded anything. And one real ``weightship-serve`` process serving a
generated model, healthy, so the stand-ins cannot drift from the real server's series.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from controlplane.rollouts.analysis import AnalysisPhase
from gpu_loader.metrics import ServeMetrics
from tests.conftest import REPO
from tests.gpu_loader.server_process import PROMPT, ServerProcess
from tests.gpu_loader.staged_versions import manifest_of, stage
from tests.prometheus_examples import (
    MetricsTarget,
    Prometheus,
    doc_metrics,
    doc_prometheus,  # noqa: F401 - the fixture
    judge,
    scraped_by,
)
from weightship.testing import eventually

DOC = REPO / "docs" / "rollouts.md"
METRICS = doc_metrics(DOC)


class StandIn:
    """One model server's metrics, changed as ``weightship-serve`` changes them."""

    def __init__(self) -> None:
        self.metrics = ServeMetrics()
        self.target = MetricsTarget(self.metrics.registry)
        self.serving: tuple[str, int] | None = None

    def loaded(self, digest: str, epoch: int, *, passed: bool) -> None:
        """A load of ``digest`` ended; a passed one is swapped in, a refused one leaves the old serving."""
        self.metrics.validation.labels(digest=digest).set(1 if passed else 0)
        if not passed:
            return
        if self.serving is not None:
            self.metrics.version.remove(self.serving[0], str(self.serving[1]))
        self.metrics.ready.set(1)
        self.metrics.version.labels(digest=digest, epoch=str(epoch)).set(1)
        self.serving = (digest, epoch)

    def answer(self, requests: int, code: int = 200, seconds: float = 0.02) -> None:
        """``requests`` requests answered with ``code`` after ``seconds`` each."""
        for _ in range(requests):
            self.metrics.requests.labels(code=str(code)).inc()
            self.metrics.latency.observe(seconds)
            if code >= 500:
                self.metrics.errors.inc()


def _digest() -> str:
    return "sha256:" + uuid.uuid4().hex * 2


#: traffic after the step began, per canary: (requests, code, seconds) batches
TRAFFIC: dict[str, list[tuple[int, int, float]]] = {
    "healthy": [(60, 200, 0.02)],
    "refused": [(60, 200, 0.02)],  # answered by the previous version: the canary never loaded
    "erroring": [(50, 200, 0.02), (10, 500, 0.02)],
    "slow": [(60, 200, 2.0)],
    "loaded-late": [(60, 200, 0.02)],
    "never-ready": [],
}


@dataclass(frozen=True)
class Fleet:
    """Canary digests by name, the stable digest, and when the analysis step began."""

    canaries: dict[str, str]
    stable: str
    step_started_at: datetime
    before: datetime
    prometheus: Prometheus


@pytest.fixture(scope="module")
def fleet(doc_prometheus: Prometheus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:  # noqa: F811
    """A stable server and one server per canary, scraped; traffic sent after the step began."""
    from gpu_loader.modelgen import generate  # imports torch: only when this module runs

    stable = _digest()
    canaries = {name: _digest() for name in TRAFFIC}
    servers = {name: StandIn() for name in ("stable", *TRAFFIC)}
    root = tmp_path_factory.mktemp("real-serve")
    version = stage(generate(root / "model", size_mb=1, seed=51).directory, root / "data")
    (root / "serve").mkdir()
    real = ServerProcess(["--version-dir", str(version), "--device", "cpu"], root / "serve")
    canaries["real-healthy"] = manifest_of(version).digest
    try:
        eventually(lambda: real.ready_digest() == canaries["real-healthy"], 120, "the real server to serve")
        for name, server in servers.items():
            if name not in ("loaded-late", "never-ready"):
                server.loaded(stable, 1, passed=True)
        before = datetime.now(UTC)
        targets = {name: s.target.address for name, s in servers.items()}
        targets["real-healthy"] = str(real.client.base_url).removeprefix("http://").rstrip("/")
        with scraped_by(doc_prometheus, targets) as test:
            for batch, answered in ((12, 12), (13, 25)):  # while it was loading, before the step; a scrape apart
                servers["loaded-late"].answer(batch, code=503)
                eventually(
                    lambda: doc_prometheus.value(f'sum(weightship_serve_requests_total{{test="{test}", code="503"}})') == answered,  # noqa: B023
                    60,
                    "Prometheus to scrape the 503s answered before the step",
                )  # fmt: skip
            started = datetime.now(UTC)
            for name in TRAFFIC:
                if name != "never-ready":
                    servers[name].loaded(canaries[name], 2, passed=name != "refused")
            # Two scrapes of the switched servers before any traffic, so the window holds a sample before it.
            switched = canaries["healthy"]
            eventually(
                lambda: (doc_prometheus.value(f'count_over_time(weightship_serve_version_info{{digest="{switched}"}}[1m])') or 0) >= 2,
                60,
                "two scrapes after the switch",
            )  # fmt: skip
            # In two halves, a scrape apart: a counter's series appears with its first request, and
            # increase() counts only what it saw grow (as with real servers' first requests).
            total = 25.0
            for half in (0, 1):
                for name, batches in TRAFFIC.items():
                    for requests, code, seconds in batches:
                        servers[name].answer(requests // 2, code, seconds)
                        total += requests // 2
                servers["stable"].answer(30)
                for _ in range(10):
                    assert real.client.post("/v1/generate", json=PROMPT).status_code == 200
                total += 30 + 10
                eventually(
                    lambda: doc_prometheus.value(f'sum(weightship_serve_requests_total{{test="{test}"}})') == total,  # noqa: B023
                    60,
                    f"Prometheus to scrape half {half + 1} of the requests",
                )
            time.sleep(1.1)  # ok-sleep: one more scrape interval, so rate() sees the last samples twice
            yield Fleet(canaries, stable, started, before, doc_prometheus)
    finally:
        for server in servers.values():
            server.target.close()
        real.stop()


def test_the_doc_has_the_three_examples() -> None:
    assert [m["name"] for m in METRICS] == ["canary-serving", "error-rate", "p99-latency"]


@pytest.mark.parametrize(
    ("canary", "phase", "failing"),
    [
        ("healthy", AnalysisPhase.SUCCESSFUL, set()),
        ("real-healthy", AnalysisPhase.SUCCESSFUL, set()),
        ("loaded-late", AnalysisPhase.SUCCESSFUL, set()),
        ("refused", AnalysisPhase.FAILED, {"canary-serving", "error-rate", "p99-latency"}),
        ("never-ready", AnalysisPhase.FAILED, {"canary-serving", "error-rate", "p99-latency"}),
        ("erroring", AnalysisPhase.FAILED, {"error-rate"}),
        ("slow", AnalysisPhase.FAILED, {"p99-latency"}),
    ],
)
async def test_documented_analysis_fails_what_it_should(
    fleet: Fleet, canary: str, phase: AnalysisPhase, failing: set[str]
) -> None:
    step = await judge(METRICS, fleet.prometheus, canary=fleet.canaries[canary], stable=fleet.stable,
                       step_started_at=fleet.step_started_at)  # fmt: skip
    assert step.phase is phase, (step.message, step.values)
    for metric in METRICS:
        alone = await judge([metric], fleet.prometheus, canary=fleet.canaries[canary], stable=fleet.stable,
                            step_started_at=fleet.step_started_at)  # fmt: skip
        expected = AnalysisPhase.FAILED if metric["name"] in failing else AnalysisPhase.SUCCESSFUL
        assert alone.phase is expected, (metric["name"], alone.message, alone.values)


async def test_the_window_is_the_step_not_the_server_lifetime(fleet: Fleet) -> None:
    """The 503s a server answered while loading count only when the window reaches back to them."""
    error_rate = [m for m in METRICS if m["name"] == "error-rate"]
    canary = fleet.canaries["loaded-late"]
    within_step = await judge(error_rate, fleet.prometheus, canary=canary, step_started_at=fleet.step_started_at)
    assert within_step.phase is AnalysisPhase.SUCCESSFUL, within_step.values
    since_start = await judge(error_rate, fleet.prometheus, canary=canary, step_started_at=fleet.before)
    assert since_start.phase is AnalysisPhase.FAILED, since_start.values
