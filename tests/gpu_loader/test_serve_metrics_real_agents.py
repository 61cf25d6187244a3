"""Serving metrics end to end: two GPU nodes, each an agent and a ``weightship-serve``, and a control plane.

Every part is its own process. The model servers push their per-version counters to their agent,
the agents heartbeat them, the control plane samples them; the built-in analysis provider then
judges the canary against the stable version over the same window, and ``/metrics`` exports the
autoscaling signals. A canary model server is restarted mid-way: its counters restart from 0 and
the window still only grows.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.fleet import in_canary
from controlplane.persistence.engine import make_engine, make_sessionmaker
from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.providers.builtin import BuiltinProvider
from gpu_loader.modelgen import generate
from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.gpu_loader.server_process import PROMPT, ServerProcess, started_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUESTS = 12


def node_names() -> tuple[str, str]:
    """A node outside and a node inside chat's canary subset at share 0.5."""
    names = (f"gpu-node-{i}" for i in itertools.count())
    stable = next(n for n in names if not in_canary("chat", n, 0.5))
    canary = next(n for n in names if in_canary("chat", n, 0.5))
    return stable, canary


def serve(agent: AgentProcess, directory: Path) -> ServerProcess:
    directory.mkdir(parents=True, exist_ok=True)
    args = ["--agent", agent.url, "--deployment", "chat", "--poll-seconds", "5", "--metrics-push-seconds", "0.2"]
    return ServerProcess(args, directory)


def answer(server: ServerProcess, times: int) -> set[str]:
    """Send ``times`` generate requests; the digests that answered."""
    seen = set()
    for _ in range(times):
        response = server.client.post("/v1/generate", json=PROMPT)
        assert response.status_code == 200, response.text
        seen.add(response.json()["digest"])
    return seen


Scraped = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(cp: ControlPlaneProcess) -> Scraped:
    text = httpx.get(f"{cp.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_model_server_counters_reach_the_builtin_provider_and_metrics_through_real_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_SERVE_SAMPLE_SECONDS", "0.5")
    # The autoscaling gauges show once samples cover half their window: 20 s after start-up rather than
    # 30 s; 40 s still holds every request the test sends.
    monkeypatch.setenv("WEIGHTSHIP_SIGNAL_WINDOW_SECONDS", "40")
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agents: list[AgentProcess] = []
    servers: list[ServerProcess] = []
    engine = make_engine(cp.database_url)
    try:
        await cp.ready()
        generate(tmp_path / "m1", size_mb=2, seed=11)
        generate(tmp_path / "m2", size_mb=2, seed=11, variant=1)
        with cp.client() as admin:
            v1 = admin.publish_directory(tmp_path / "m1", "tiny", ["v1"]).version.digest
            v2 = admin.publish_directory(tmp_path / "m2", "tiny", ["v2"]).version.digest
            token = admin.create_token("serve-metrics", "agent").token
            epoch = admin.create_deployment("chat", "tiny").epoch
            epoch = admin.set_pointer("chat", "v1", expected_epoch=epoch).epoch
        (tmp_path / "agents").mkdir()
        for name in node_names():
            agent = AgentProcess(tmp_path / "agents", name, cp.url, token, ["chat"])
            agents.append(agent)
            agent.start()
        for agent in agents:
            await agent.ready()
        # Both servers start at once, while the agents fetch v1 (each server waits for its agent's version).
        starting = asyncio.ensure_future(
            started_together(*(functools.partial(serve, a, tmp_path / f"serve-{i}") for i, a in enumerate(agents)))
        )
        try:
            for agent in agents:
                await agent.serving(v1)
        finally:
            servers = list(await starting)
        for server in servers:
            await eventually(lambda s=server: s.ready_digest() == v1, 120, "v1 served")  # type: ignore[misc]

        with cp.client() as admin:
            admin.set_pointer("chat", "v1", canary="v2", canary_share=0.5, expected_epoch=epoch)
        stable_server, canary_server = servers
        await eventually(lambda: canary_server.ready_digest() == v2, 120, "the canary node serving v2")
        assert answer(stable_server, REQUESTS) == {v1}
        assert answer(canary_server, REQUESTS) == {v2}

        builtin = BuiltinProvider(make_sessionmaker(engine), stale_seconds=10.0, retention_seconds=3600.0)
        context = RolloutContext("r1", "chat", v2, v1)
        index = itertools.count()
        async with ProviderRegistry.default(builtin=builtin) as providers:

            async def measure(metric: str, **settings: Any) -> Any:
                action = MeasureMetric("run", metric, next(index), "builtin", {"metric": metric, **settings})
                result = await providers.measure(action, context)
                assert result.error is None, result.error
                return result.value

            async def counted(expected: int) -> Any:
                found = await measure("errorRate", window=cp.window_since_start())
                ok = found is not None and (found["canary_requests"], found["stable_requests"]) == (expected, REQUESTS)
                return found if ok else None

            errors = await eventually(lambda: counted(REQUESTS), 60, "both versions' requests in the window")
            assert (errors["canary"], errors["stable"], errors["delta"]) == (0.0, 0.0, 0.0)
            latency = await measure("latencyP99", window=cp.window_since_start())
            assert 0 < latency["canary"] <= 10.0
            validation = await measure("validation", window=cp.window_since_start())
            assert (validation["canary_passed"], validation["canary_failed"], validation["canary"]) == (1, 0, 0.0)

            # The canary's model server restarts: its counters start again from 0, the window only grows.
            canary_server.stop()
            servers[1] = canary_server = serve(agents[1], tmp_path / "serve-restarted")
            await eventually(lambda: canary_server.ready_digest() == v2, 120, "the restarted server serving v2")
            assert answer(canary_server, 3) == {v2}
            await eventually(lambda: counted(REQUESTS + 3), 60, "the restarted server's requests added")

        def exported() -> Scraped | None:
            found = scrape(cp)
            return (
                found
                if ("weightship_deployment_request_rate", (("deployment", "chat"), ("version", v2))) in found
                else None
            )

        signals = await eventually(exported, 30, "the autoscaling signals on /metrics")

        def value(name: str, version: str) -> float:
            return signals[(name, (("deployment", "chat"), ("version", version)))]

        assert value("weightship_deployment_request_rate", v1) > 0
        assert value("weightship_deployment_request_rate", v2) > 0
        assert value("weightship_deployment_queue_depth", v2) == 0
        assert (value("weightship_deployment_serving_nodes", v1), value("weightship_deployment_serving_nodes", v2)) == (
            1,
            1,
        )
        # The canary node still holds v1 verified but serves v2: one node of warm capacity for the stable version.
        assert value("weightship_deployment_staged_capacity_nodes", v1) == 1
    finally:
        engine.dispose()
        for server in servers:
            server.stop()
        for agent in agents:
            await agent.close()
        cp.stop()
