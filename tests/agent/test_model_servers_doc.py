"""docs/model-servers.md's analysis templates, run in real rollouts against stand-in vLLM and TGI servers.

Real processes: the control plane (its rollout driver ticking), two agents whose switch hooks
reload a stand-in server each (``tests.agent.external_server``: vLLM names through an HTTP hook,
TGI names through a command hook that also rewrites the instance's file_sd entry with the
digest, as the doc's TGI recipe does), and a real Prometheus scraping the stand-ins every second.
The metrics are the doc's own, read from its marked YAML blocks; only the Prometheus address and
the timing (seconds instead of minutes) are the test's. A healthy canary is promoted; a canary
whose weights make every request fail is rolled back, and its server then serves the stable
version again.
"""

from __future__ import annotations

import contextlib
import json
import re
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from controlplane.fleet import in_canary
from tests.agent.agent_processes import REPO, AgentProcess, eventually
from tests.agent.controlplane_process import ADMIN_TOKEN, ControlPlaneProcess
from tests.agent.external_server import ExternalServerProcess, load
from tests.controlplane.rollouts.providers.conftest import Prometheus, prometheus  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DOC = REPO / "docs" / "model-servers.md"
NODES = ("node-0", "node-1")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def doc_templates() -> dict[str, list[dict[str, Any]]]:
    """The YAML blocks marked ``<!-- analysis-template: NAME -->`` in docs/model-servers.md, by name."""
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"<!-- analysis-template: (\w+) -->\n```yaml\n(.*?)```", text, flags=re.DOTALL)
    return {name: yaml.safe_load(body) for name, body in found}


def test_the_doc_holds_a_vllm_and_a_tgi_template_that_fail_a_silent_canary() -> None:
    templates = doc_templates()
    assert set(templates) == {"vllm", "tgi"}
    for metrics in templates.values():
        for metric in metrics:
            assert metric["noData"] == "failed"
            assert "{{canary}}" in metric["provider"]["prometheus"]["query"]


def for_test(metrics: list[dict[str, Any]], server: Prometheus) -> list[dict[str, Any]]:
    """The doc's metrics with the test's Prometheus and seconds instead of minutes; queries and conditions untouched."""
    timed = {"initialDelay": "4s", "interval": "3s", "count": 3}
    ours = {"address": server.url, "timeout": "2s"}
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
    """Requests to every server, back to back, on a thread, until stopped (answers are not checked)."""

    def __init__(self, servers: list[ExternalServerProcess]) -> None:
        self.servers = servers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                for server in self.servers:
                    route = "/generate" if server.flavour == "tgi" else "/v1/completions"
                    with contextlib.suppress(httpx.HTTPError):
                        http.post(server.url + route, json={"prompt": "hi", "inputs": "hi"})
                self._stop.wait(0.02)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


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
def target_files(prometheus: Prometheus) -> Iterator[list[Path]]:  # noqa: F811 - the imported fixture
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
    prometheus: Prometheus,  # noqa: F811 - the imported fixture
    target_files: list[Path],
) -> None:
    metrics = for_test(doc_templates()[flavour], prometheus)
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

            body: dict[str, Any] = await eventually(settled, 90, f"the rollout of {version} to settle")
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
