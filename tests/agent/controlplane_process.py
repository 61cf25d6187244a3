"""The real control plane (``python -m controlplane serve``) as a process, for integration tests.

SQLite and a local-directory origin under the test's directory; blob URLs are signed by the
control plane and served by it (range requests), at ``public_url`` (itself, or a proxy in front
of it). It can be stopped (SIGTERM) or killed (SIGKILL) and started again on the same port with
the same database, as after a deploy or a crash; and its database can be backed up while it runs
and restored while it is down, as an operator restoring from a backup would.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.agent.agent_processes import REPO, eventually
from weightship.client import Client
from weightship.testing import eventually as poll_until
from weightship.testing import free_port

ADMIN_TOKEN = "ws_agent-tests-admin-token-0123456789abcdef"


class ControlPlaneProcess:
    """One control-plane process with its own database and origin."""

    def __init__(self, workdir: Path, public_url: str | None = None, database_url: str | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        #: where the blob URLs it signs point (a proxy in front of it, or itself)
        self.public_url = public_url or self.url
        self.database = workdir / "cp.db"
        #: SQLite under ``workdir`` unless another database (PostgreSQL, shared by replicas) is named
        self.database_url = database_url or f"sqlite:///{self.database}"
        self.log_path = workdir / "controlplane.log"
        #: its ``--log-level``; quiet unless a test reads what it logs
        self.log_level = "warning"
        self.proc: subprocess.Popen[bytes] | None = None
        #: when ``start()`` last launched it (``time.monotonic()``)
        self.started_at: float | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Launch it (it migrates the database at start-up); ``ready()`` waits until it answers."""
        env = {
            **os.environ,
            "WEIGHTSHIP_DATABASE_URL": self.database_url,
            "WEIGHTSHIP_STORE": f"local:{self.workdir / 'origin'}",
            "WEIGHTSHIP_ADMIN_TOKEN": ADMIN_TOKEN,
            "WEIGHTSHIP_PUBLIC_URL": self.public_url,
            "WEIGHTSHIP_URL_SIGNING_KEY": "agent-tests-signing-key",
            "WEIGHTSHIP_NODE_STALE_SECONDS": "10",
        }
        argv = [sys.executable, "-m", "controlplane", "serve", "--port", str(self.port), "--log-level", self.log_level]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.started_at = time.monotonic()

    def window_since_start(self) -> str:
        """A serving-traffic window (``"37s"``) reaching back to this process's start: every request served since.

        Its samples cover half of it (what a window needs) a few seconds after start-up, where a fixed
        ``60s`` window would wait 30 s after start-up for them.
        """
        assert self.started_at is not None, "start() it first"
        return f"{math.ceil(time.monotonic() - self.started_at) + 1}s"

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"control plane exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        with httpx.Client(timeout=2) as http:
            return http.get(self.url + "/readyz").status_code == 200

    async def ready(self, within: float = 60.0) -> None:
        """Wait until ``/readyz`` answers 200 (the database is migrated)."""
        await eventually(self._answers, within, "the control plane to be ready")

    def wait_ready(self, within: float = 60.0) -> None:
        """``ready()`` for synchronous callers (module-wide fixtures)."""
        poll_until(self._answers, within, "the control plane to be ready")

    def client(self, token: str = ADMIN_TOKEN) -> Client:
        """A REST client (admin by default)."""
        return Client(self.url, token, timeout=30.0)

    def stop(self) -> None:
        """SIGTERM and wait (uvicorn lets open long-polls finish first)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: the control plane crashes, mid-request and without any clean-up."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def backup(self, target: Path) -> None:
        """An online backup of the database (SQLite's backup API), taken while it serves."""
        source = sqlite3.connect(self.database)
        copy = sqlite3.connect(target)
        try:
            source.backup(copy)
        finally:
            copy.close()
            source.close()

    def restore(self, backup: Path) -> None:
        """Replace the database with ``backup`` (only while the process is down)."""
        assert self.proc is None or self.proc.poll() is not None, "stop the control plane before restoring"
        for leftover in (Path(f"{self.database}-wal"), Path(f"{self.database}-shm")):
            leftover.unlink(missing_ok=True)  # newer commits of the crashed process: gone with the restore
        shutil.copyfile(backup, self.database)

    def parked(self) -> float:
        """The desired-state long-polls it holds right now, from its ``/metrics``."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        line = next(line for line in text.splitlines() if line.startswith("weightship_desired_long_polls "))
        return float(line.split()[1])

    def log(self) -> str:
        """What it logged."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
