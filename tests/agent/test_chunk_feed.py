"""A model server loading a version while a real agent still fetches it (the chunk feed).

The agent is a process fetching through the fleet's fault proxy; the loader follows the agent's
``/local/v1/versions/{digest}/chunks`` long-poll (``gpu_loader.streamfeed``). The proxy holds the
fetch part-way, damages a chunk on its first trip, and the agent is killed mid-load, so the load
meets each failure while it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_loader.agent_api import LocalAgent
from gpu_loader.loader import Loader, LoadOptions, load_state_dict
from gpu_loader.modelgen import generate
from gpu_loader.streamfeed import StreamedLoad, stream_load
from gpu_loader.streaming import StreamingSession
from tests.agent.agent_processes import Spawn, eventually
from tests.agent.fleet import Fleet
from tests.gpu_loader.server_process import PROMPT, ServerProcess
from weightship.testing import FaultProxy, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _same(got: StreamedLoad, model_dir: Path) -> None:
    expected = load_state_dict(model_dir, manifest=got.version.manifest)
    assert got.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got.tensors[name], tensor), name


async def test_a_streamed_load_waits_out_a_held_fetch_and_never_reads_a_corrupt_chunk(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, make_model: Callable[..., Path], model: str, deployment: str
) -> None:
    model_dir = make_model("streamed", tensors_mb=1.0, seed=5)
    manifest = fleet.publish(model_dir, model, "v1")
    weights = next(f for f in manifest.files if f.path.endswith(".safetensors"))
    damaged: set[int] = set()

    def corrupt_first_time(blob: str, start: int) -> bool:
        if blob == weights.sha256 and start == 2 * manifest.chunk_size and start not in damaged:
            damaged.add(start)
            return True
        return False

    proxy.corrupt = corrupt_first_time
    proxy.hold_after = 6
    fleet.point(deployment, model, "v1")
    agent = spawn("node-s", extra=["--concurrency", "2"])
    await agent.ready()
    client = LocalAgent(agent.url)
    sessions: list[StreamingSession] = []
    states: list[str] = []
    try:
        with Loader(LoadOptions(readers=2)) as loader:
            task = asyncio.create_task(
                stream_load(client, manifest.digest, deployment, loader, poll_seconds=2.0,
                            on_state=lambda s, _r: states.append(s), on_session=sessions.append)
            )
            await eventually(lambda: proxy.held() > 0 and bool(sessions), 30, "the fetch to be held part-way")
            await eventually(lambda: sessions[0].stream.chunks_ready > 0, 30, "the load to take verified chunks")
            assert not task.done()  # chunks are still missing: the load waits for them
            proxy.release()
            got = await asyncio.wait_for(task, 60)
    finally:
        await client.aclose()
    assert got is not None
    assert proxy.corrupted  # a damaged chunk came in, was rejected by the agent and fetched again
    _same(got, model_dir)
    assert got.progress.tensors_loaded == got.progress.tensors_total
    assert "fetching" in states


async def test_a_streamed_load_survives_the_agent_killed_mid_fetch_and_finishes_after_its_restart(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, make_model: Callable[..., Path], model: str, deployment: str
) -> None:
    model_dir = make_model("killed", tensors_mb=1.0, seed=6)
    manifest = fleet.publish(model_dir, model, "v1")
    proxy.hold_after = 5
    fleet.point(deployment, model, "v1")
    listen = f"127.0.0.1:{free_port()}"
    agent = spawn("node-k", extra=["--concurrency", "2", "--local-api", listen])
    await agent.ready()
    client = LocalAgent(agent.url)
    sessions: list[StreamingSession] = []
    states: list[str] = []
    try:
        with Loader(LoadOptions(readers=2)) as loader:
            task = asyncio.create_task(
                stream_load(client, manifest.digest, deployment, loader, poll_seconds=2.0,
                            on_state=lambda s, _r: states.append(s), on_session=sessions.append)
            )
            await eventually(lambda: proxy.held() > 0 and bool(sessions), 30, "the fetch to be held part-way")
            await eventually(lambda: sessions[0].stream.chunks_ready > 0, 30, "the load to take verified chunks")
            agent.kill9()
            await eventually(lambda: "agent_unavailable" in states, 30, "the load to see the agent gone")
            assert not task.done()
            proxy.release()
            agent.start()
            got = await asyncio.wait_for(task, 60)
    finally:
        await client.aclose()
    assert got is not None
    _same(got, model_dir)


async def test_a_pinned_server_cold_on_a_version_being_fetched_answers_only_once_its_last_tensor_is_loaded(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, model: str, deployment: str, tmp_path: Path
) -> None:
    generate(tmp_path / "servable", size_mb=2, seed=21)
    manifest = fleet.publish(tmp_path / "servable", model, "v1")
    proxy.hold_after = 10
    fleet.point(deployment, model, "v1")
    agent = spawn("node-v", extra=["--concurrency", "2"])
    await agent.ready()
    args = ["--agent", agent.url, "--deployment", deployment, "--digest", manifest.digest, "--poll-seconds", "5"]
    (tmp_path / "server").mkdir()
    with ServerProcess(args, tmp_path / "server") as server:

        def loading() -> dict[str, object] | None:
            status = server.client.get("/v1/status").json()
            return status.get("loading") if proxy.held() > 0 else None

        progress = await eventually(loading, 60, "the server to start a streaming load while the fetch is held")
        assert progress["tensors_loaded"] < progress["tensors_total"]  # type: ignore[operator]
        assert server.client.post("/v1/generate", json=PROMPT).status_code == 503
        assert server.client.get("/readyz").status_code == 503
        proxy.release()
        await eventually(lambda: server.ready_digest() == manifest.digest, 60, "the server to serve the version")
        assert server.client.post("/v1/generate", json=PROMPT).status_code == 200
        done = server.client.get("/v1/status").json()["loading"]
        assert done["tensors_loaded"] == done["tensors_total"]
        assert "load.stream_planned" in server.log()


async def test_a_server_with_streaming_off_loads_only_the_installed_version(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, model: str, deployment: str, tmp_path: Path
) -> None:
    generate(tmp_path / "servable", size_mb=1, seed=22)
    manifest = fleet.publish(tmp_path / "servable", model, "v1")
    fleet.point(deployment, model, "v1")
    agent = spawn("node-q")
    await agent.ready()
    args = ["--agent", agent.url, "--deployment", deployment, "--digest", manifest.digest, "--no-stream"]
    (tmp_path / "server").mkdir()
    with ServerProcess(args, tmp_path / "server") as server:
        await eventually(lambda: server.ready_digest() == manifest.digest, 60, "the server to serve the version")
        assert "loading" not in server.client.get("/v1/status").json()
        assert "load.stream_planned" not in server.log()


async def test_a_streamed_version_that_fails_validation_is_refused_and_reported_like_any_other(
    spawn: Spawn, fleet: Fleet, proxy: FaultProxy, model: str, deployment: str, tmp_path: Path
) -> None:
    generate(tmp_path / "poisoned", size_mb=1, seed=23, corrupt="nan")
    manifest = fleet.publish(tmp_path / "poisoned", model, "v1")
    proxy.hold_after = 6
    fleet.point(deployment, model, "v1")
    agent = spawn("node-n", extra=["--concurrency", "2"])
    await agent.ready()
    args = ["--agent", agent.url, "--deployment", deployment, "--digest", manifest.digest]
    (tmp_path / "server").mkdir()
    with ServerProcess(args, tmp_path / "server") as server:
        await eventually(lambda: "loading" in server.client.get("/v1/status").json(), 60, "a streaming load")
        proxy.release()
        refused = await eventually(lambda: server.client.get("/readyz").json().get("refused"), 60, "the refusal")
        assert "finite" in refused
        assert server.client.post("/v1/generate", json=PROMPT).status_code == 503
        line = f"validation.received deployment={deployment} digest={manifest.digest} passed=False"
        await eventually(lambda: line in agent.log(), 30, "the agent to hear the failed validation")
