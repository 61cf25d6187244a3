"""``weightship-serve --digest``: a server pinned to one version, beside another on the same node.

Every part is its own process, as on a Kubernetes GPU node: the control plane, one agent started
with no ``--deployment`` at all (it follows what its model servers ask for), and two pinned
servers, as the canary and the stable pod of a ModelRollout would be. The pointer's moves go
through the REST API; the pinned servers must not follow them.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controlplane.persistence.engine import make_engine, make_sessionmaker
from controlplane.rollouts.actions import MeasureMetric
from controlplane.rollouts.providers import ProviderRegistry, RolloutContext
from controlplane.rollouts.providers.builtin import BuiltinProvider
from gpu_loader.modelgen import generate
from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.gpu_loader.server_process import PROMPT, REPO, ServerProcess, started_together
from weightship.schemas import NodeHeartbeat, VersionState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def pinned(agent: AgentProcess, digest: str, directory: Path, *extra: str) -> ServerProcess:
    """A server pinned to ``digest`` of deployment ``chat``, its files under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    args = ["--agent", agent.url, "--deployment", "chat", "--digest", digest, "--poll-seconds", "2",
            "--metrics-push-seconds", "0.2", "--lease-seconds", "6", *extra]  # fmt: skip
    return ServerProcess(args, directory)


def answers(server: ServerProcess, times: int = 1) -> set[str | None]:
    """The digests that ``times`` generate requests were answered with (``None``: not ready)."""
    seen: set[str | None] = set()
    for _ in range(times):
        response = server.client.post("/v1/generate", json=PROMPT)
        seen.add(str(response.json()["digest"]) if response.status_code == 200 else None)
    return seen


async def applied(agent: AgentProcess, epoch: int) -> bool:
    """Whether the agent applied ``chat``'s pointer at ``epoch`` (its version ready)."""
    view = await agent.deployment("chat")
    return view is not None and view.epoch >= epoch and view.ready


async def test_pinned_servers_on_one_node_each_serve_their_own_version_through_promotion_and_rollback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_SERVE_SAMPLE_SECONDS", "0.5")
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agent: AgentProcess | None = None
    servers: list[ServerProcess] = []
    engine = make_engine(cp.database_url)
    try:
        await cp.ready()
        generate(tmp_path / "m1", size_mb=2, seed=11)
        generate(tmp_path / "m2", size_mb=2, seed=11, variant=1)
        with cp.client() as admin:
            v1 = admin.publish_directory(tmp_path / "m1", "tiny", ["v1"]).version.digest
            v2 = admin.publish_directory(tmp_path / "m2", "tiny", ["v2"]).version.digest
            token = admin.create_token("pinned", "agent").token
            epoch = admin.create_deployment("chat", "tiny").epoch
            epoch = admin.set_pointer("chat", "v1", expected_epoch=epoch).epoch

        # No --deployment: the agent stages what its model servers ask for.
        agent = AgentProcess(tmp_path / "agents", "gpu-node-1", cp.url, token, [])
        agent.data_dir.parent.mkdir(parents=True)
        agent.start()
        await agent.ready()
        # Both pinned servers start at once (each start-up imports torch): the stable one asks for v1, which
        # the pointer names; the canary one for v2, which no pointer names yet.
        canary, stable = await started_together(
            functools.partial(pinned, agent, v2, tmp_path / "canary"),
            functools.partial(pinned, agent, v1, tmp_path / "stable"),
        )
        servers += [canary, stable]

        # v2 is named by no pointer yet: the canary server waits, and says for what.
        def waiting() -> dict[str, Any] | None:
            answer = canary.client.get("/readyz")
            body = answer.json()
            found = body.get("waiting_for") or {}
            # Once the agent follows chat (it did not before the server asked), the pointer says why not.
            named = found.get("state") == "unknown" and v1 in found.get("reason", "")
            return body if answer.status_code == 503 and named else None

        refused = await eventually(waiting, 60, "the canary server to wait for v2, saying the pointer names v1")
        assert refused["pinned"] == v2
        assert refused["waiting_for"]["digest"] == v2
        assert refused["waiting_for"]["deployment"] == "chat"
        status = canary.client.get("/v1/status").json()
        assert (status["ready"], status["pinned"], status["waiting_for"]["digest"]) == (False, v2, v2)
        assert answers(canary) == {None}

        # The rollout stages v2 as the canary at share 0 (the Kubernetes operator's way): the node fetches it.
        with cp.client() as admin:
            epoch = admin.set_pointer("chat", "v1", canary="v2", canary_share=0.0, expected_epoch=epoch).epoch
        await eventually(lambda: canary.ready_digest() == v2, 120, "the canary server serving v2")
        await eventually(lambda: stable.ready_digest() == v1, 120, "the stable server serving v1")
        await eventually(lambda: applied(agent, epoch), 60, "the agent applying the canary pointer")
        # The node itself serves the stable version: the canary server's answer is not the pointer's.
        assert (await agent.deployment("chat")) is not None
        assert answers(canary, 5) == {v2}
        assert answers(stable, 3) == {v1}

        # The built-in analysis tells the two apart by digest, though both run on one node.
        builtin = BuiltinProvider(make_sessionmaker(engine), stale_seconds=10.0, retention_seconds=3600.0)
        index = itertools.count()
        async with ProviderRegistry.default(builtin=builtin) as providers:

            async def counted() -> Any:
                settings = {"metric": "errorRate", "window": cp.window_since_start()}
                action = MeasureMetric("run", "errorRate", next(index), "builtin", settings)
                result = await providers.measure(action, RolloutContext("r1", "chat", v2, v1))
                assert result.error is None, result.error
                found = result.value
                ok = isinstance(found, dict) and (found["canary_requests"], found["stable_requests"]) == (5, 3)
                return found if ok else None

            judged = await eventually(counted, 60, "canary and stable counters, by digest, in the window")
            assert (judged["canary"], judged["stable"]) == (0.0, 0.0)

        # Promotion, then rollback: the node's pointer moves, neither pinned server does.
        with cp.client() as admin:
            epoch = admin.set_pointer("chat", "v2", expected_epoch=epoch).epoch
        await eventually(lambda: applied(agent, epoch), 60, "the agent applying the promotion")
        assert (await agent.deployment("chat")).digest == v2  # type: ignore[union-attr]
        assert (answers(canary, 2), answers(stable, 2)) == ({v2}, {v1})
        with cp.client() as admin:
            epoch = admin.rollback("chat", reason="pinned test").epoch
        await eventually(lambda: applied(agent, epoch), 60, "the agent applying the rollback")
        assert (await agent.deployment("chat")).digest == v1  # type: ignore[union-attr]
        assert (answers(canary, 2), answers(stable, 2)) == ({v2}, {v1})
        for server in (canary, stable):
            assert server.metric("weightship_serve_swaps_total") == 0.0
        assert "deployments.follow" in agent.log()
    finally:
        engine.dispose()
        for server in servers:
            server.stop()
        if agent is not None:
            await agent.close()
        cp.stop()


def test_a_digest_that_is_not_one_is_refused_at_start() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpu_loader.serve", "--agent", "http://127.0.0.1:9", "--digest", "v2"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--digest 'v2': give a version digest, sha256:<64 hex digits>" in proc.stderr


def held(status: NodeHeartbeat) -> set[str]:
    """The versions an agent's report lists as ready on disk."""
    return {v.digest for v in status.inventory if v.state == VersionState.ready}


async def test_a_version_a_pinned_server_serves_is_not_evicted_until_the_server_is_gone(tmp_path: Path) -> None:
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agent: AgentProcess | None = None
    server: ServerProcess | None = None
    try:
        await cp.ready()
        digests: list[str] = []
        with cp.client() as admin:
            for i in range(5):
                generate(tmp_path / f"m{i}", size_mb=1, seed=11, variant=i)
                published = admin.publish_directory(tmp_path / f"m{i}", "tiny", [f"v{i}"]).version
                digests.append(published.digest)
            size = published.size
            token = admin.create_token("pinned-retention", "agent").token
            epoch = admin.create_deployment("chat", "tiny").epoch
            epoch = admin.set_pointer("chat", "v0", expected_epoch=epoch).epoch
        v0, v1, v2, v3, v4 = digests
        # Room for three versions and a half: the fourth makes the agent evict one.
        quota = ["--quota", str(int(size * 3.5)), "--min-free", "0"]
        agent = AgentProcess(tmp_path / "agents", "gpu-node-1", cp.url, token, ["chat"], quota)
        agent.data_dir.parent.mkdir(parents=True)
        agent.start()
        await agent.ready()
        await agent.serving(v0)
        server = pinned(agent, v0, tmp_path / "serve", "--lease-seconds", "3")
        await eventually(lambda: server is not None and server.ready_digest() == v0, 120, "the server serving v0")

        for label, digest in (("v1", v1), ("v2", v2), ("v3", v3)):
            with cp.client() as admin:
                epoch = admin.set_pointer("chat", label, expected_epoch=epoch).epoch
            await agent.serving(digest)
        # v3 needed room; v0 and v1 were both unreferenced by the pointer (which keeps v3 and v2), and
        # only v0 is served: v1 goes, v0 stays.
        assert held(await agent.status()) == {v0, v2, v3}
        assert answers(server, 2) == {v0}

        # The server dies without a word: its lease lapses, and v0 is evictable again.
        server.proc.kill()
        server.proc.wait(timeout=20)
        # v4 as a canary at share 0: the node keeps v3, v2 and v4, so only v0 can make room for it.
        with cp.client() as admin:
            admin.set_pointer("chat", "v3", canary="v4", canary_share=0.0, expected_epoch=epoch)

        async def staged() -> set[str] | None:
            found = held(await agent.status())
            return found if v4 in found else None

        assert await eventually(staged, 90, "v4 staged once v0's lease lapsed") == {v2, v3, v4}
        assert "retention.evicted digest=" + v0 in agent.log()
    finally:
        if server is not None:
            server.stop()
        if agent is not None:
            await agent.close()
        cp.stop()
