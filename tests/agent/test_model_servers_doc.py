"""docs/model-servers.md's analysis templates, against stand-in vLLM and TGI servers and a real Prometheus.

The metrics are the doc's own, read from its marked YAML blocks (``tests.prometheus_examples``).

- Real rollouts: the control plane (its rollout driver ticking), two agents whose switch hooks
  reload a stand-in server each (``tests.agent.external_server``: vLLM names through an HTTP hook,
  TGI names through a command hook that also rewrites the instance's file_sd entry with the
  digest, as the doc's TGI recipe does). Only the Prometheus address and the timing (seconds
  instead of minutes) are the test's. A healthy canary is promoted; a canary whose weights make
  every request fail is rolled back, and its server then serves the stable version again.
- Pinned servers (one version each, as a Kubernetes pod): the metrics exactly as written, judged by
  the real engine and Prometheus provider, pass a healthy canary and fail a refusing, an erroring
  and a slow one.
"""

from __future__ import annotations

import contextlib
import json
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from controlplane.fleet import in_canary
from controlplane.rollouts.analysis import AnalysisPhase
from tests.agent.agent_processes import REPO, AgentProcess, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.agent.external_server import ExternalServerProcess, load
from tests.prometheus_examples import (
    Prometheus,
    doc_metrics,
    doc_prometheus,  # noqa: F401 - the fixture
    judge,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOC = REPO / "docs" / "model-servers.md"
NODES = ("node-0", "node-1")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


TEMPLATES = {flavour: doc_metrics(DOC, flavour) for flavour in ("vllm", "tgi")}


def test_the_doc_holds_a_vllm_and_a_tgi_template_that_fail_a_silent_canary() -> None:
    for metrics in TEMPLATES.values():
        assert [m["name"] for m in metrics] == ["error-rate", "p99-latency"]
        for metric in metrics:
            assert metric["noData"] == "failed"
            assert "{{canary}}" in metric["provider"]["prometheus"]["query"]
            assert "[{{window}}]" in metric["provider"]["prometheus"]["query"]


def for_test(metrics: list[dict[str, Any]], server: Prometheus) -> list[dict[str, Any]]:
    """The doc's metrics with the test's Prometheus and seconds instead of minutes; queries and conditions untouched."""
    # Generous for a loaded test machine: a scrape or a file_sd refresh that lags must not leave two gaps.
    timed = {"initialDelay": "8s", "interval": "4s", "count": 3}
    ours = {"address": server.url, "timeout": "3s"}
    return [{**m, **timed, "provider": {"prometheus": {**m["provider"]["prometheus"], **ours}}} for m in metrics]


def split_deployment_name(prefix: str) -> str:
    """A deployment name whose 50 % canary subset holds exactly one of NODES."""
    for i in range(200):
        name = f"{prefix}-{i}"
        if sum(in_canary(name, node, 0.5) for node in NODES) == 1:
            return name
    raise AssertionError("no deployment name splits the nodes")


def broken_model(root: Path) -> Path:
    """A model directory whose weights hold a NaN: the stand-in answers every request with 500."""
    root.mkdir(parents=True)
    weights = np.ones((64, 64), dtype=np.float32)
    weights[3, 7] = np.nan
    save_file({"model.layers.0.mlp.up_proj.weight": weights}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return root


def measured(rollout: dict[str, Any]) -> dict[str, list[float]]:
    """The values each metric of the rollout's analysis measured (no-data measurements left out)."""
    found: dict[str, list[float]] = {}
    for run in rollout["analysis_runs"]:
        for metric in run["metrics"]:
            values = [m["value"][0] for m in metric["measurements"] if m["value"]]
            found.setdefault(metric["name"], []).extend(values)
    return found


class Traffic:
    """Requests to each server back to back, one thread per server, until stopped (answers are not checked)."""

    def __init__(self, servers: list[ExternalServerProcess]) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in servers]

    def _run(self, server: ExternalServerProcess) -> None:
        route = "/generate" if server.flavour == "tgi" else "/v1/completions"
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    http.post(server.url + route, json={"prompt": "hi", "inputs": "hi"})
                self._stop.wait(0.02)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def tgi_hook(script: Path, server: ExternalServerProcess, target_file: Path, label: str) -> str:
    """The TGI recipe's command hook for the stand-in: reload it, then give its file_sd entry the new digest."""
    script.write_text(
        "#!/bin/sh\nset -e\n"
        f'kill -HUP "$(cat "{server.pidfile}")"\n'
        f"printf '[{{\"targets\":[\"127.0.0.1:{server.port}\"],\"labels\":"
        f'{{"digest":"%s","deployment":"%s","test":"{label}"}}}}]\' '
        f'"$WEIGHTSHIP_DIGEST" "$WEIGHTSHIP_DEPLOYMENT" > "{target_file}.tmp"\n'
        f'mv "{target_file}.tmp" "{target_file}"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return f"command:{script}"


@pytest.fixture
def rollout_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control plane's rollout driver ticks every 0.3 s (the process inherits the environment)."""
    monkeypatch.setenv("WEIGHTSHIP_ROLLOUT_TICK_SECONDS", "0.3")


@pytest.fixture
def target_files() -> Iterator[list[Path]]:
    """file_sd files this test writes (or its hooks write); removed at the end."""
    files: list[Path] = []
    yield files
    for path in files:
        path.unlink(missing_ok=True)


@pytest.mark.usefixtures("rollout_tick")
@pytest.mark.parametrize("flavour", ["vllm", "tgi"])
async def test_the_docs_analysis_promotes_a_healthy_canary_and_rolls_back_an_erroring_one(
    flavour: str,
    tmp_path: Path,
    make_model: Callable[..., Path],
    doc_prometheus: Prometheus,  # noqa: F811 - the imported fixture
    target_files: list[Path],
) -> None:
    prometheus = doc_prometheus
    metrics = for_test(TEMPLATES[flavour], prometheus)
    label = f"model-servers-{flavour}-{uuid.uuid4().hex[:8]}"
    deployment = split_deployment_name(f"chat-{flavour}")
    prometheus.targets.mkdir(parents=True, exist_ok=True)
    controlplane = ControlPlaneProcess(tmp_path / "controlplane")
    controlplane.start()
    servers: list[ExternalServerProcess] = []
    agents: list[AgentProcess] = []
    http = httpx.AsyncClient(base_url=controlplane.url, headers=ADMIN, timeout=30)
    try:
        await controlplane.ready()
        dirs = {"v1": make_model("v1", tensors_mb=0.25, seed=11), "v2": make_model("v2", tensors_mb=0.25, seed=12)}
        dirs["v3"] = broken_model(tmp_path / "v3")
        with controlplane.client() as admin:
            digests = {v: admin.publish_directory(d, "m", [v], chunk_size=65536).version.digest for v, d in dirs.items()}
            token = admin.create_token("agents", "agent").token
            admin.create_deployment(deployment, "m")
            admin.set_pointer(deployment, "v1", expected_epoch=0)
        answers = {v: load(d).answer for v, d in dirs.items() if v != "v3"}

        fleet = tmp_path / "fleet"
        fleet.mkdir()
        for node in NODES:
            link = fleet / node / "deployments" / deployment / "current"
            extra = ["--served-model-name-is-digest", "--served-model-name", "chat"] if flavour == "vllm" else []
            server = ExternalServerProcess(tmp_path / f"server-{node}", link, *extra, flavour=flavour).start()
            servers.append(server)
            target_file = prometheus.targets / f"{label}-{node}.json"
            target_files.append(target_file)
            if flavour == "vllm":
                target_file.write_text(json.dumps([{"targets": [f"127.0.0.1:{server.port}"], "labels": {"test": label}}]))
                hook = f"http://127.0.0.1:{server.port}/reload"
            else:
                hook = tgi_hook(tmp_path / f"hook-{node}.sh", server, target_file, label)
            agent = AgentProcess(fleet, node, controlplane.url, token, [deployment], ["--switch-hook", f"{deployment}={hook}"])
            agent.start()
            agents.append(agent)
        for agent in agents:
            await agent.ready()

        def everyone_answers(version: str) -> bool:
            return all(s.answer() == answers[version] for s in servers)

        await eventually(lambda: everyone_answers("v1"), 90, "both servers to serve v1")

        def scraped() -> bool:
            return len(prometheus.query(f'up{{test="{label}"}} == 1')) == len(NODES)

        await eventually(scraped, 60, "Prometheus to scrape both servers")

        async def rollout(version: str, phase: str) -> dict[str, Any]:
            spec = {"version": version, "steps": [{"setWeight": 50}, {"analysis": {"metrics": metrics}}]}
            created = await http.post(f"/v1/deployments/{deployment}/rollouts", json={"spec": spec})
            assert created.status_code == 201, created.text
            url = f"/v1/deployments/{deployment}/rollouts/{created.json()['id']}"

            async def settled() -> dict[str, Any] | None:
                answer = (await http.get(url)).json()
                return dict(answer) if answer["phase"] in ("Healthy", "Degraded", "Paused") else None

            body: dict[str, Any] = await eventually(settled, 150, f"the rollout of {version} to settle")
            assert body["phase"] == phase, json.dumps(body, indent=1)[:4000]
            return body

        with Traffic(servers):
            promoted = await rollout("v2", "Healthy")
            await eventually(lambda: everyone_answers("v2"), 60, "both servers to serve the promoted v2")
            values = measured(promoted)
            # Measured, not no data (at most one gap, e.g. the first scrape after a reload): the queries find the canary.
            assert len(values["error-rate"]) >= 2
            assert set(values["error-rate"]) == {0.0}
            assert len(values["p99-latency"]) >= 2
            assert all(0 < v < 2.5 for v in values["p99-latency"])

            canary = next(s for s, n in zip(servers, NODES, strict=True) if in_canary(deployment, n, 0.5))
            failed = await rollout("v3", "Degraded")
            assert "AnalysisFailed" in failed["message"]
            assert any(v > 0.01 for v in measured(failed)["error-rate"])  # the 500s, counted on the canary
            await eventually(lambda: everyone_answers("v2"), 60, "the canary's server to serve v2 again")

        if flavour == "vllm":  # the HTTP hook's calls, as the canary's server received them
            announced = [c["digest"] for c in canary.reloads()]
            assert announced == [digests["v1"], digests["v2"], digests["v3"], digests["v2"]]
        deployment_now = (await http.get(f"/v1/deployments/{deployment}")).json()
        assert deployment_now["stable"] == digests["v2"]
    finally:
        await http.aclose()
        for agent in agents:
            await agent.close()
        for server in servers:
            server.stop()
        controlplane.stop()


#: the pinned canaries of the judge test: extra stand-in flags, and the metrics expected to fail
CANARIES: dict[str, tuple[list[str], set[str]]] = {
    "healthy": ([], set()),
    "erroring": ([], {"error-rate", "p99-latency"}),  # every request fails: no latency to measure, no data
    "slow": (["--latency", "3"], {"p99-latency"}),
    "refusing": ([], {"error-rate", "p99-latency"}),
}


def pinned_version(root: Path, kind: str, make_model: Callable[..., Path]) -> Path:
    """A version directory named by a digest's hex, as the agent lays them out: ``versions/<hex>``."""
    directory = root / "versions" / (uuid.uuid4().hex * 2)
    if kind == "erroring":
        return broken_model(directory)
    directory.mkdir(parents=True)
    if kind != "refusing":  # a refusing server finds no weights it will load
        source = make_model(f"model-{kind}", tensors_mb=0.05, seed=len(kind))
        for file in source.iterdir():
            (directory / file.name).write_bytes(file.read_bytes())
    return directory


@pytest.mark.parametrize("flavour", ["vllm", "tgi"])
async def test_the_docs_analysis_fails_a_refusing_an_erroring_and_a_slow_canary_and_passes_a_healthy_one(
    flavour: str,
    tmp_path: Path,
    make_model: Callable[..., Path],
    doc_prometheus: Prometheus,  # noqa: F811 - the imported fixture
    target_files: list[Path],
) -> None:
    """Pinned servers (one version each, as in a Kubernetes pod), judged by the doc's metrics as they stand."""
    metrics = TEMPLATES[flavour]
    label = f"pinned-{flavour}-{uuid.uuid4().hex[:8]}"
    servers: dict[str, ExternalServerProcess] = {}
    digests: dict[str, str] = {}
    try:
        for kind, (flags, _failing) in CANARIES.items():
            version = pinned_version(tmp_path, kind, make_model)
            digests[kind] = f"sha256:{version.name}"
            extra = [*flags, "--served-model-name-is-digest", "--served-model-name", "chat"] if flavour == "vllm" else flags
            servers[kind] = ExternalServerProcess(tmp_path / kind, version, *extra, flavour=flavour).start()
            # As the doc's PodMonitor does for a pinned pod: the digest from its annotation, on every series.
            target = doc_prometheus.targets / f"{label}-{kind}.json"
            target_files.append(target)
            labels = {"test": label, "digest": digests[kind]}
            target.write_text(json.dumps([{"targets": [f"127.0.0.1:{servers[kind].port}"], "labels": labels}]))

        def scraped() -> bool:  # every server but the refusing one, which exports nothing
            return len(doc_prometheus.query(f'up{{test="{label}"}} == 1')) == len(CANARIES) - 1

        await eventually(scraped, 60, "Prometheus to scrape the servers")
        step_started_at = datetime.now(UTC)
        with Traffic(list(servers.values())):
            slow = "tgi_request_duration_count" if flavour == "tgi" else "vllm:e2e_request_latency_seconds_count"

            def slow_answers_seen() -> bool:  # two scrapes of the slow server's answered requests
                total = f'{slow}{{test="{label}", digest="{digests["slow"]}"}}'
                if flavour == "vllm":
                    total = f'{slow}{{test="{label}", model_name="{digests["slow"]}"}}'
                return len(doc_prometheus.query(f"count_over_time(({total} > 0)[30s:1s]) >= 2")) == 1

            await eventually(slow_answers_seen, 60, "Prometheus to see the slow server answer")
        for kind, (_flags, failing) in CANARIES.items():
            step = await judge(metrics, doc_prometheus, canary=digests[kind], step_started_at=step_started_at)
            expected = AnalysisPhase.FAILED if failing else AnalysisPhase.SUCCESSFUL
            assert step.phase is expected, (kind, step.message, step.values)
            for metric in metrics:
                alone = await judge([metric], doc_prometheus, canary=digests[kind], step_started_at=step_started_at)
                expected = AnalysisPhase.FAILED if metric["name"] in failing else AnalysisPhase.SUCCESSFUL
                assert alone.phase is expected, (kind, metric["name"], alone.message, alone.values)
    finally:
        for server in servers.values():
            server.stop()

