"""The real control plane (``python -m controlplane serve``) as a process, for integration tests.

SQLite and a local-directory origin under the test's directory; blob URLs are signed by the
control plane and served by it (range requests). It can be stopped and started again on the same
port with the same database, as after a crash or a deploy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.agent.agent_processes import REPO, eventually
from weightship.client import Client

ADMIN_TOKEN = "ws_agent-tests-admin-token-0123456789abcdef"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ControlPlaneProcess:
    """One control-plane process with its own database and origin."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "controlplane.log"
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Launch it (migrating the database) and wait until it answers ``/readyz``."""
        env = {
            **os.environ,
            "WEIGHTSHIP_DATABASE_URL": f"sqlite:///{self.workdir / 'cp.db'}",
            "WEIGHTSHIP_STORE": f"local:{self.workdir / 'origin'}",
            "WEIGHTSHIP_ADMIN_TOKEN": ADMIN_TOKEN,
            "WEIGHTSHIP_PUBLIC_URL": self.url,
            "WEIGHTSHIP_URL_SIGNING_KEY": "agent-tests-signing-key",
            "WEIGHTSHIP_NODE_STALE_SECONDS": "10",
        }
        argv = [sys.executable, "-m", "controlplane", "serve", "--port", str(self.port), "--log-level", "warning"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    async def ready(self, within: float = 60.0) -> None:
        """Wait until ``/readyz`` answers 200 (the database is migrated)."""

        async def probe() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"control plane exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(self.url + "/readyz")).status_code == 200

        await eventually(probe, within, "the control plane to be ready")

    def client(self, token: str = ADMIN_TOKEN) -> Client:
        """A REST client (admin by default)."""
        return Client(self.url, token, timeout=30.0)

    def stop(self) -> None:
        """SIGTERM and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log(self) -> str:
        """What it logged."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
