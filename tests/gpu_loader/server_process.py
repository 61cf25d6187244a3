"""The reference model server as a process, for the tests that drive it over HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from weightship.testing import eventually as poll_until

REPO = Path(__file__).resolve().parents[2]


PROMPT = {"input_ids": [[5, 17, 42, 7, 99, 3, 64, 12]], "max_new_tokens": 2}


class ServerProcess:
    """``python -m gpu_loader.serve`` on a free port, its output kept in a log file."""

    def __init__(self, args: list[str], tmp_path: Path) -> None:
        self.port_file = tmp_path / "serve.port"
        self.log_path = tmp_path / "serve.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_loader.serve", *args, "--port", "0", "--port-file", str(self.port_file),
             "--checksum-dir", str(tmp_path / "crc"), "--workers", "2"],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        port = poll_until(self._port, 60, "the server to listen")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def _port(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        return self.port_file.read_text() if self.port_file.exists() and self.port_file.read_text() else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready_digest(self) -> str | None:
        response = self.client.get("/readyz")
        return response.json()["digest"] if response.status_code == 200 else None

    def metric(self, line_start: str) -> float | None:
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def started_together(*starts: Callable[[], ServerProcess]) -> list[ServerProcess]:
    """Run each of ``starts`` (each returns a listening server) at once, in threads: the servers' start-ups
    (each imports torch, seconds) overlap. If any fails, the others are stopped and the first error raised."""
    results = await asyncio.gather(*(asyncio.to_thread(start) for start in starts), return_exceptions=True)
    servers = [r for r in results if isinstance(r, ServerProcess)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers
