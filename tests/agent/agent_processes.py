"""Real agent processes for tests: ``python -m agent`` with its own data directory and log file.

``AgentProcess.start()`` launches the agent; ``await ready()`` waits until it has written
``agent.json`` (its local API is then listening). Every wait polls with a deadline: nothing
sleeps a fixed time to wait for a condition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from weightship.schemas import LocalDeployment, NodeHeartbeat
from weightship.testing import eventually_async as eventually
from weightship.testing import kill9, terminate

__all__ = ["POLL", "REPO", "AgentProcess", "Spawn", "eventually"]

REPO = Path(__file__).resolve().parents[2]
_T = TypeVar("_T")
POLL = 0.05


class AgentProcess:
    """One ``weightship-agent`` process under test."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        control_plane: str,
        token: str,
        deployments: Sequence[str] = ("chat",),
        extra: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.data_dir = workdir / name
        self.log_path = workdir / f"{name}.log"
        self.control_plane = control_plane
        self.token = token
        self.deployments = list(deployments)
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._http = httpx.AsyncClient(timeout=10.0)

    def argv(self) -> list[str]:
        """The command line (fast heartbeats and backoff so tests stay short)."""
        argv = [
            sys.executable,
            "-m",
            "agent",
            "--control-plane",
            self.control_plane,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--local-api",
            "127.0.0.1:0",
            "--heartbeat-interval",
            "0.5",
            "--poll-wait",
            "10",
            "--backoff-initial",
            "0.05",
            "--backoff-max",
            "1",
        ]
        for d in self.deployments:
            argv += ["--deployment", d]
        return argv + self.extra

    def start(self) -> None:
        """Launch the process (the token goes through the environment, not argv)."""
        (self.data_dir / "agent.json").unlink(missing_ok=True)
        env = {**os.environ, "WEIGHTSHIP_AGENT_TOKEN": self.token}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    async def ready(self, within: float = 60.0) -> str:
        """Wait until the agent's local API is up; returns its URL."""
        assert self.proc is not None

        async def probe() -> str | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"agent {self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            path = self.data_dir / "agent.json"
            if not path.exists():
                return None
            doc = json.loads(path.read_text())
            return str(doc["local_api"]) if doc.get("pid") == self.proc.pid else None

        self.url = await eventually(probe, within, f"agent {self.name} to start")
        return self.url

    def kill9(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        assert self.proc is not None
        kill9(self.proc)

    def stop(self) -> None:
        """SIGTERM and wait."""
        terminate(self.proc)

    async def close(self) -> None:
        """Stop the process and the HTTP client."""
        self.stop()
        await self._http.aclose()

    def log(self) -> str:
        """Everything the agent logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def get(self, path: str, **params: str | int | float) -> httpx.Response:
        """GET on the local API."""
        return await self._http.get(self.url + path, params=params)

    async def post(self, path: str, content: bytes) -> httpx.Response:
        """POST on the local API."""
        return await self._http.post(self.url + path, content=content)

    async def deployment(self, name: str | None = None) -> LocalDeployment | None:
        """What the local API says ``name`` (default: its first deployment) serves; ``None`` before any pointer."""
        name = name or self.deployments[0]
        response = await self.get(f"/local/v1/deployments/{name}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return LocalDeployment.model_validate_json(response.content)

    async def status(self) -> NodeHeartbeat:
        """The agent's own report (``GET /local/v1/status``)."""
        response = await self.get("/local/v1/status")
        response.raise_for_status()
        return NodeHeartbeat.model_validate_json(response.content)

    async def serving(self, digest: str, name: str | None = None, within: float = 60.0) -> LocalDeployment:
        """Wait until ``name`` (default: its first deployment) serves ``digest``, ready."""
        name = name or self.deployments[0]

        async def probe() -> LocalDeployment | None:
            view = await self.deployment(name)
            return view if view is not None and view.digest == digest and view.ready else None

        return await eventually(probe, within, f"agent {self.name} to serve {digest[:19]} for {name}")


#: ``spawn(name, deployments=None, extra=())`` -> a started ``AgentProcess`` (fixture in conftest)
Spawn = Callable[..., AgentProcess]
