"""Run the analysis examples of a doc against a real Prometheus, so the doc cannot drift from what works.

What a test of a documented analysis needs, in one place (``docs/rollouts.md``'s tests and
``docs/model-servers.md``'s use it):

- :func:`doc_metrics` reads the analysis metrics out of a doc's ``yaml`` blocks: every mapping with
  a ``provider: {prometheus: ...}`` is one metric, exactly as a user would paste it;
- :func:`running_prometheus` / the ``doc_prometheus`` fixture: the Prometheus ``make test`` started
  (``WEIGHTSHIP_TEST_PROMETHEUS_URL`` and ``WEIGHTSHIP_TEST_PROMETHEUS_TARGETS``), or one started
  with ``scripts/prometheus.sh`` in a temporary directory; it scrapes every target listed in its
  ``targets/*.json`` every second;
- :class:`MetricsTarget` is a real HTTP server exposing a ``prometheus_client`` registry, for
  metric families a test drives (a stand-in exposes the same families as the real server, e.g.
  ``gpu_loader.metrics.ServeMetrics``); :func:`scraped_by` lists targets for Prometheus to scrape;
- :func:`judge` runs the metrics as one analysis step through the real engine and the real
  Prometheus provider (only ``address`` is replaced), with the step starting at a given moment, and
  returns the run's verdict. The engine's clock moves on by itself (intervals, initial delays),
  while Prometheus answers as of the real now, so ``{{window}}`` spans the real time since the step
  began.

Import the fixture into a test module or conftest: ``from tests.prometheus_examples import doc_prometheus``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.analysis import AnalysisPhase
from controlplane.rollouts.engine import reconcile
from controlplane.rollouts.observations import FleetObservation, Observations, PointerObservation
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.spec import parse_spec
from controlplane.rollouts.status import RolloutStatus
from weightship.testing import eventually, free_port

__all__ = [
    "Judgement",
    "MetricsTarget",
    "Prometheus",
    "doc_metrics",
    "doc_prometheus",
    "judge",
    "running_prometheus",
    "scraped_by",
]

REPO = Path(__file__).resolve().parents[1]


# --- Prometheus ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prometheus:
    """A running Prometheus and the file_sd directory whose ``*.json`` files it scrapes."""

    url: str
    targets: Path

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` gives now (raises on an error answer)."""
        answer = httpx.post(f"{self.url}/api/v1/query", data={"query": promql}, timeout=10).json()
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def value(self, promql: str) -> float | None:
        """The single value of an aggregated query, None when it is empty."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None


@contextlib.contextmanager
def running_prometheus(directory: Path) -> Iterator[Prometheus]:
    """The Prometheus of ``make test`` when its variables are set, else one started in ``directory``."""
    url, targets = os.environ.get("WEIGHTSHIP_TEST_PROMETHEUS_URL"), os.environ.get("WEIGHTSHIP_TEST_PROMETHEUS_TARGETS")
    if url and targets:
        yield Prometheus(url.rstrip("/"), Path(targets))
        return
    script = REPO / "scripts" / "prometheus.sh"
    started = subprocess.run(
        [str(script), "start", str(directory), str(free_port())], capture_output=True, text=True, timeout=900
    )
    if started.returncode != 0:
        if "not installed" in started.stderr and "not root" in started.stderr:
            pytest.skip(f"Prometheus is absent and cannot be installed here: {started.stderr.strip()}")
        raise AssertionError(f"scripts/prometheus.sh start failed ({started.returncode}):\n{started.stderr}")
    try:
        yield Prometheus(started.stdout.strip(), directory / "targets")
    finally:
        subprocess.run([str(script), "stop", str(directory)], timeout=60, check=False)


@pytest.fixture(scope="session")
def doc_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus scraping every second (see :func:`running_prometheus`)."""
    with running_prometheus(tmp_path_factory.mktemp("doc-prometheus")) as prometheus:
        yield prometheus


# --- scrape targets ------------------------------------------------------------------------------


class MetricsTarget:
    """A real HTTP server answering ``GET /metrics`` with ``registry``'s exposition, on 127.0.0.1."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(target.registry)
                self.send_response(200 if self.path.startswith("/metrics") else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: Prometheus scrapes every second."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"metrics-{self.address}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> MetricsTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def scraped_by(prometheus: Prometheus, targets: Mapping[str, str], **labels: str) -> Iterator[str]:
    """Have ``prometheus`` scrape ``targets`` (role -> host:port) while inside; yields their ``test`` label.

    Every series gets the labels ``test`` (unique per call), ``role`` and ``labels``.
    """
    test = f"doc-{uuid.uuid4().hex[:10]}"
    groups = [
        {"targets": [address], "labels": {"test": test, "role": role, **labels}} for role, address in targets.items()
    ]
    prometheus.targets.mkdir(parents=True, exist_ok=True)
    path = prometheus.targets / f"{test}.json"
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(groups))
    staging.rename(path)  # file_sd must never read a half-written file
    try:
        want = len(groups)
        eventually(
            lambda: prometheus.value(f'count(up{{test="{test}"}} == 1)') == want, 60, f"Prometheus to scrape {test}"
        )
        yield test
    finally:
        path.unlink(missing_ok=True)


# --- the doc's metrics ---------------------------------------------------------------------------


def doc_metrics(doc: Path, marker: str | None = None) -> list[dict[str, Any]]:
    """Every analysis metric with a Prometheus provider in ``doc``'s ``yaml`` blocks, in order.

    With ``marker``, only the block right after the line ``<!-- analysis-template: MARKER -->``.
    A block that does not parse as YAML fails the test: a user pastes these.
    """
    text = doc.read_text()
    blocks: list[str] = []
    lines = text.splitlines()
    i = 0
    wanted = marker is None
    while i < len(lines):
        line = lines[i].strip()
        if marker is not None and line == f"<!-- analysis-template: {marker} -->":
            wanted = True
        if line == "```yaml":
            end = lines.index("```", i + 1)
            if wanted:
                blocks.append("\n".join(lines[i + 1 : end]))
                wanted = marker is None
            i = end
        i += 1
    metrics: list[dict[str, Any]] = []
    for block in blocks:
        metrics.extend(_metrics_in(yaml.safe_load(block)))
    return metrics


def _metrics_in(node: object) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        provider = node.get("provider")
        if isinstance(provider, dict) and "prometheus" in provider and "name" in node:
            yield node
            return
        for value in node.values():
            yield from _metrics_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from _metrics_in(item)


# --- judging -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Judgement:
    """How an analysis step ended, and every value each metric measured (for failure messages)."""

    phase: AnalysisPhase
    message: str
    values: dict[str, list[str]] = field(default_factory=dict)


def _digest() -> str:
    return "sha256:" + uuid.uuid4().hex * 2


async def judge(
    metrics: Sequence[Mapping[str, Any]],
    prometheus: Prometheus,
    *,
    canary: str,
    stable: str | None = None,
    step_started_at: datetime,
    deployment: str = "chat",
    seconds: float = 3600,
) -> Judgement:
    """Run ``metrics`` as one analysis step of a rollout of ``canary`` and return the run's verdict.

    The step starts at ``step_started_at`` on the engine's clock, which then moves ahead in 5 s
    ticks (at most ``seconds`` of it) so intervals and initial delays pass at once; each
    measurement queries the real Prometheus, which answers as of the real now.
    """
    checked = []
    for metric in metrics:
        settings = dict(metric["provider"]["prometheus"])
        settings["address"] = prometheus.url
        checked.append({**metric, "provider": {"prometheus": settings}})
    stable = stable or _digest()
    spec = parse_spec({"version": canary, "steps": [{"analysis": {"metrics": checked}}]})
    now = step_started_at
    async with ProviderRegistry.default(clock=lambda: now) as providers:
        providers.check_spec(spec)
        context = RolloutContext("doc-example", deployment, canary, stable)
        pointer = PointerObservation(stable, canary, 0.1, 7)
        status: RolloutStatus | None = None
        end = step_started_at + timedelta(seconds=seconds)
        while now <= end:
            observations = Observations(pointer, FleetObservation(target_nodes=1), version_bytes=0)
            result = reconcile(spec, status, observations, now)
            wanted = [action for action in result.actions if isinstance(action, MeasureMetric)]
            if wanted:
                taken = tuple([await providers.measure(action, context) for action in wanted])
                with_answers = Observations(pointer, FleetObservation(target_nodes=1), 0, None, taken)
                result = reconcile(spec, status, with_answers, now)
            status = result.status
            run = status.run_for_step(0)
            if run is not None and run.phase not in (AnalysisPhase.PENDING, AnalysisPhase.RUNNING):
                values = {m.name: [f"{x.phase}: {x.value!r} {x.message}" for x in m.measurements] for m in run.metrics}
                return Judgement(run.phase, status.message, values)
            now += timedelta(seconds=5)
    raise AssertionError(f"the analysis did not end within {seconds}s of engine time: {status and status.message}")
