"""docs/monitoring.md's scrape configuration, rendered into a real Prometheus against real processes.

The ``scrape_configs`` block is read out of the doc; each job's example targets are replaced by the
addresses of real processes of that kind (a control plane, a node agent with ``--metrics-listen``
and no peer listener, a cache, and a ``weightship-serve`` following the node's agent), everything
else is kept, and a Prometheus of our own runs on it. Every target must be up, and the node agent's
fetch counters must be scraped though it runs no peer listener.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_loader.modelgen import generate
from tests.agent.agent_processes import AgentProcess, Spawn, eventually
from tests.agent.fleet import Fleet
from tests.agent.peers import peer_url, start_cache
from tests.conftest import REPO
from tests.gpu_loader.server_process import ServerProcess
from tests.prometheus_examples import Prometheus
from weightship.testing import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOC = REPO / "docs" / "monitoring.md"


def doc_scrape_configs() -> list[dict[str, Any]]:
    """The ``scrape_configs`` of the doc's first YAML block that has them."""
    text = DOC.read_text()
    for block in text.split("```yaml")[1:]:
        found = yaml.safe_load(block.split("```", 1)[0])
        if isinstance(found, dict) and "scrape_configs" in found:
            return list(found["scrape_configs"])
    raise AssertionError(f"{DOC} has no YAML block with scrape_configs")


def render(configs: list[dict[str, Any]], targets: dict[str, list[str]]) -> dict[str, Any]:
    """The doc's jobs with their example hosts replaced by ``targets`` (by job name), scraped every second."""
    jobs = []
    for job in configs:
        name = job["job_name"]
        assert name in targets, f"the test runs no process for job {name!r}"
        groups = job["static_configs"]
        assert len(groups) == 1, f"job {name}: one static_configs group expected"
        jobs.append({**job, "static_configs": [{**groups[0], "targets": targets[name]}]})
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}


def _runtime(agent: AgentProcess) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((agent.data_dir / "agent.json").read_text())
    return doc


async def test_every_target_of_the_documented_scrape_config_is_up(
    tmp_path: Path, fleet: Fleet, spawn: Spawn, model: str, deployment: str
) -> None:
    generate(tmp_path / "m1", size_mb=1, seed=7)
    v1 = fleet.publish(tmp_path / "m1", model, "v1")
    fleet.point(deployment, model, "v1")
    cache = start_cache(tmp_path, fleet, f"{model[:50]}-cache")
    server: ServerProcess | None = None
    directory = tmp_path / "prometheus"
    script = REPO / "scripts" / "prometheus.sh"
    try:
        await cache.ready()
        node = spawn(f"{model[:50]}-gpu", extra=["--metrics-listen", "127.0.0.1:0", "--cluster-cache", peer_url(cache)])
        await node.ready()
        # Well within the tracker's 30 s upstream lease: a node without a peer listener announces
        # what it fetched, which ends its grants (it would otherwise stall until they expired).
        await node.serving(v1.digest, within=20)
        assert not _runtime(node)["peer"], "the node runs no peer listener"
        (tmp_path / "serve").mkdir()
        server = ServerProcess(["--agent", node.url, "--deployment", deployment], tmp_path / "serve")
        await eventually(lambda: server is not None and server.ready_digest() == v1.digest, 120, "v1 served")

        def address(url: str) -> str:
            return url.removeprefix("http://").rstrip("/")

        targets = {
            "weightship-controlplane": [address(fleet.cp.url)],
            "weightship-agents": [address(_runtime(node)["metrics"])],
            "weightship-caches": [address(peer_url(cache))],
            "weightship-serve": [address(str(server.client.base_url))],
        }
        directory.mkdir()
        config = directory / "prometheus.yml"
        config.write_text(yaml.safe_dump(render(doc_scrape_configs(), targets)))
        started = await asyncio.to_thread(subprocess.run, [str(script), "start", str(directory), str(free_port()),
                                          str(config)], capture_output=True, text=True, timeout=900)  # fmt: skip
        if started.returncode != 0 and "not installed" in started.stderr and "not root" in started.stderr:
            pytest.skip(f"Prometheus is absent and cannot be installed here: {started.stderr.strip()}")
        assert started.returncode == 0, started.stderr
        prometheus = Prometheus(started.stdout.strip(), directory / "targets")

        def all_up() -> list[dict[str, Any]] | None:
            up = prometheus.query('up{job=~"weightship-.*"}')
            return up if len(up) == 4 and all(float(s["value"][1]) == 1 for s in up) else None

        up = await eventually(all_up, 60, "every documented target up")
        assert {s["metric"]["job"] for s in up} == set(targets)
        serve_labels = prometheus.query('weightship_serve_ready{job="weightship-serve"}')
        assert serve_labels, "the model server's own series are scraped"
        assert serve_labels[0]["metric"]["deployment"] == "chat", "the scrape config's labels are kept"
        fetched = prometheus.query('sum(weightship_fetch_source_bytes_total{job="weightship-agents"})')
        assert fetched, "the node's fetch counters are scraped without a peer listener"
        assert float(fetched[0]["value"][1]) >= v1.total_size
    finally:
        await asyncio.to_thread(subprocess.run, [str(script), "stop", str(directory)], timeout=60, check=False)
        if server is not None:
            server.stop()
        await cache.close()
