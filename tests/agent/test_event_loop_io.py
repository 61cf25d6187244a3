"""The agent's event loop never waits on the disk: every fsync runs in a worker thread.

A heartbeat or a local-API request is answered by the event loop; if the loop itself flushed
the epoch book, a ``current`` link or the LRU record, every model server on the host would stall
behind that flush (on a busy disk, hundreds of milliseconds). The agent runs in this process
here, against the real control plane (a process), so the thread of every ``fsync`` can be seen.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.config import AgentConfig
from agent.daemon import Agent
from tests.agent.agent_processes import eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.agent.fleet_fakes import TEST_CHUNK
from weightship.manifest import Manifest, parse_manifest

pytestmark = pytest.mark.timeout(120)


def publish(cp: ControlPlaneProcess, model_dir: Path, label: str) -> Manifest:
    with cp.client() as admin:
        version = admin.publish_directory(model_dir, "m", [label], chunk_size=TEST_CHUNK).version
        return parse_manifest(admin.get_manifest("m", version.digest))


async def test_switches_rollbacks_and_touches_never_fsync_on_the_event_loop(
    tmp_path: Path,
    controlplane: ControlPlaneProcess,
    make_model: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    v1 = publish(controlplane, make_model("a", tensors_mb=0.3, seed=1), "v1")
    v2 = publish(controlplane, make_model("b", tensors_mb=0.3, seed=2), "v2")
    with controlplane.client() as admin:
        token = admin.create_token("loop-io", "agent").token
        epoch = admin.create_deployment("chat", "m").epoch
    loop_thread = threading.get_ident()
    on_loop: list[int] = []
    elsewhere: list[int] = []
    real_fsync = os.fsync

    def watched_fsync(fd: int) -> None:
        (on_loop if threading.get_ident() == loop_thread else elsewhere).append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    config = AgentConfig(
        control_plane=controlplane.url,
        token=token,
        name="loop-io",
        data_dir=tmp_path / "data",
        deployments=("chat",),
        local_api="127.0.0.1:0",
        heartbeat_interval=0.2,
        poll_wait=5,
        backoff_initial=0.05,
        backoff_max=0.5,
    )
    agent = Agent(config)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:

        def serves(digest: str, at: int) -> bool:
            view = agent.serving.get("chat")
            return view is not None and view.ready and view.digest == digest and view.epoch == at

        with controlplane.client() as admin:
            epoch = admin.set_pointer("chat", "v1", expected_epoch=epoch).epoch
            await eventually(lambda: serves(v1.digest, epoch), 60, "v1 served")
            epoch = admin.set_pointer("chat", "v2", expected_epoch=epoch).epoch
            await eventually(lambda: serves(v2.digest, epoch), 60, "v2 served")
            epoch = admin.rollback("chat", reason="loop io test").epoch
            await eventually(lambda: serves(v1.digest, epoch), 60, "v1 served again after the rollback")
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    assert elsewhere, "the agent flushed nothing at all: the probe is not watching"
    assert not on_loop, f"{len(on_loop)} fsync call(s) ran on the event loop thread"
    assert (tmp_path / "data" / "state" / "last_used.json").exists()
