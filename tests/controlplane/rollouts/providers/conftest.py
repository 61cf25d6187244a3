"""Fixtures for the provider tests: a real Prometheus scraping real ``weightship-serve`` processes.

- ``prometheus``: the server ``make test`` started (``WEIGHTSHIP_TEST_PROMETHEUS_URL`` and
  ``WEIGHTSHIP_TEST_PROMETHEUS_TARGETS``, its file_sd directory), or one started here with
  ``scripts/prometheus.sh`` (which installs the Debian package when it is missing). Skipped, with the
  reason, only when the binary is absent and cannot be installed.
- ``stub``: a real local aiohttp server whose answers a test scripts (webhooks, and a
  Prometheus stand-in where a real one cannot misbehave on demand: never answering, checking headers).
- ``fleet``: three model servers (``python -m gpu_loader.serve --version-dir``), each serving its own
  tiny generated version: ``stable``, ``good`` (a healthy canary) and ``bad`` (a canary answering
  400 to two of five requests). Their traffic is sent once, then Prometheus scrapes them every
  second until it sees all of it, so every test reads the same, known counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from tests.conftest import REPO
from tests.gpu_loader.staged_versions import manifest_of, stage
from tests.prometheus_examples import Prometheus
from weightship.testing import eventually as poll_until
from weightship.testing import free_port

PROMPT = {"input_ids": [[5, 17, 42, 7]], "max_new_tokens": 1}
BAD_PROMPT = {"input_ids": [[10**9]]}  # out of the vocabulary: the server answers 400


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus server scraping every second (see the module docstring)."""
    url, targets = (
        os.environ.get("WEIGHTSHIP_TEST_PROMETHEUS_URL"),
        os.environ.get("WEIGHTSHIP_TEST_PROMETHEUS_TARGETS"),
    )
    if url and targets:
        yield Prometheus(url.rstrip("/"), Path(targets))
        return
    directory = tmp_path_factory.mktemp("prometheus")
    script = REPO / "scripts" / "prometheus.sh"
    started = subprocess.run(
        [str(script), "start", str(directory), str(free_port())],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if started.returncode != 0:
        if "not installed" in started.stderr and "not root" in started.stderr:
            pytest.skip(f"Prometheus is absent and cannot be installed here: {started.stderr.strip()}")
        raise AssertionError(f"scripts/prometheus.sh start failed ({started.returncode}):\n{started.stderr}")
    try:
        yield Prometheus(started.stdout.strip(), directory / "targets")
    finally:
        subprocess.run([str(script), "stop", str(directory)], timeout=60, check=False)


class ModelServer:
    """``python -m gpu_loader.serve --version-dir DIR`` on a free port, its output in a log file."""

    def __init__(self, version_dir: Path, workdir: Path) -> None:
        workdir.mkdir(parents=True)
        self.port_file = workdir / "port"
        self.log_path = workdir / "serve.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_loader.serve", "--version-dir", str(version_dir), "--device", "cpu",
             "--port", "0", "--port-file", str(self.port_file), "--checksum-dir", str(workdir / "crc"),
             "--workers", "1"],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.port = int(str(poll_until(self._port, 120, f"the model server of {version_dir.name} to listen")))
        self.url = f"http://127.0.0.1:{self.port}"
        poll_until(lambda: httpx.get(f"{self.url}/readyz", timeout=10).status_code == 200, 120, "ready")

    def _port(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"model server exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        return self.port_file.read_text() if self.port_file.exists() and self.port_file.read_text() else None

    def send(self, good: int, bad: int) -> None:
        """``good`` requests answered 200 and ``bad`` answered 400."""
        with httpx.Client(base_url=self.url, timeout=30) as client:
            for _ in range(good):
                assert client.post("/v1/generate", json=PROMPT).status_code == 200
            for _ in range(bad):
                assert client.post("/v1/generate", json=BAD_PROMPT).status_code == 400

    def stop(self) -> None:
        """Terminate the process and close its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self._log.close()


@dataclass(frozen=True)
class Fleet:
    """Versions served and scraped: digests by role, and the ``test`` label on every series."""

    stable: str
    good: str
    bad: str
    label: str
    prometheus: Prometheus


#: Traffic sent once per session: (good, bad) requests per role.
TRAFFIC = {"stable": (4, 0), "good": (5, 0), "bad": (3, 2)}


@pytest.fixture(scope="session")
def fleet(prometheus: Prometheus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three model servers with known traffic, fully scraped (see the module docstring)."""
    from gpu_loader.modelgen import generate  # imports torch: only when a test needs the fleet

    root = tmp_path_factory.mktemp("fleet")
    versions = {
        role: stage(generate(root / "models" / role, size_mb=1, seed=seed).directory, root / "data")
        for role, seed in (("stable", 31), ("good", 32), ("bad", 33))
    }
    servers: dict[str, ModelServer] = {}
    label = f"providers-{uuid.uuid4().hex[:8]}"
    target_file = prometheus.targets / f"{label}.json"
    try:
        for role, version in versions.items():
            servers[role] = ModelServer(version, root / "servers" / role)
        for role, (good, bad) in TRAFFIC.items():
            servers[role].send(good, bad)
        prometheus.targets.mkdir(parents=True, exist_ok=True)
        groups = [
            {"targets": [f"127.0.0.1:{s.port}"], "labels": {"test": label, "role": r}} for r, s in servers.items()
        ]
        staging = target_file.with_suffix(".tmp")
        staging.write_text(json.dumps(groups))
        staging.rename(target_file)  # file_sd must never read a half-written file
        total = sum(good + bad for good, bad in TRAFFIC.values())
        poll_until(lambda: _scraped_requests(prometheus, label) == total, 90, f"Prometheus to scrape {total} requests")
        yield Fleet(
            stable=manifest_of(versions["stable"]).digest,
            good=manifest_of(versions["good"]).digest,
            bad=manifest_of(versions["bad"]).digest,
            label=label,
            prometheus=prometheus,
        )
    finally:
        target_file.unlink(missing_ok=True)
        for server in servers.values():
            server.stop()


def _scraped_requests(prometheus: Prometheus, label: str) -> float:
    result = prometheus.query(f'sum(weightship_serve_requests_total{{test="{label}"}})')
    return float(result[0]["value"][1]) if result else 0.0


@dataclass
class Received:
    """One request the stub server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class StubServer:
    """A real aiohttp server on 127.0.0.1; each test sets ``handler`` and reads ``received``."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.handler: Handler = self._default
        self.url = ""
        #: Handlers that hold a request open wait on this; it is set when the server stops.
        self.release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @staticmethod
    async def _default(request: web.Request) -> web.StreamResponse:
        return web.json_response({})

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(Received(request.method, request.path, dict(request.headers), body))
        return await self.handler(request)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def stub() -> AsyncIterator[StubServer]:
    """A real local HTTP server whose answers the test scripts."""
    server = StubServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
