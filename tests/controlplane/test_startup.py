"""``weightship-controlplane serve`` as a new user starts it: a real process, its exit code and its lines.

Each test runs ``python -m controlplane serve`` in a fresh directory (SQLite and a local store
there, as on embedded defaults) and reads what a person would: the log, the exit status, the
one error line, and whether the blob URLs it hands out actually work.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.controlplane.startup_parts import STRONG_ADMIN, _env
from weightship.client import Client
from weightship.testing import eventually, free_port

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def serving(workdir: Path, port: int, env: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """A control plane process on ``port`` until the block ends; its URL and log file."""
    log_path = workdir / "cp.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve", "--port", str(port)],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"exited {proc.returncode}: {log_path.read_text()}"
            return httpx.get(url + "/readyz", timeout=2).status_code == 200

        eventually(ready, 60, "the control plane to become ready", not_yet=(httpx.TransportError,))
        yield url, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def refused(workdir: Path, port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``serve`` expecting it to stop by itself at start-up."""
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "serve", "--port", str(port)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_a_public_url_agents_get_blob_urls_on_the_port_it_listens_on(
    tmp_path: Path, make_model: object
) -> None:
    port = free_port()
    model = make_model("m", tensors_mb=0.1)  # type: ignore[operator]
    with serving(tmp_path, port, _env(tmp_path)) as (url, log_path), Client(url, STRONG_ADMIN) as admin:
        assert f"public_url=http://127.0.0.1:{port} public_url_from=bound_address" in log_path.read_text()
        version = admin.publish_directory(model, "tiny", ["v1"], chunk_size=65536)
        manifest = admin.get_manifest("tiny", version.version.digest)
        blob = re.search(rb'"sha256":"([0-9a-f]{64})"', manifest)
        assert blob is not None
        signed = admin.blob_urls([blob.group(1).decode()]).urls[blob.group(1).decode()].url
        assert signed.startswith(f"http://127.0.0.1:{port}/v1/blobs/")
        assert httpx.get(signed, timeout=10).status_code == 200


def _other_port() -> int:
    return free_port()


BAD_URLS = [
    pytest.param(lambda: f"http://127.0.0.1:{_other_port()}", "nothing listens", id="loopback-other-port"),
    pytest.param(lambda: f"http://localhost:{_other_port()}/", "nothing listens", id="localhost-other-port"),
    pytest.param(lambda: "ftp://cp.example:8080", "not an http", id="wrong-scheme"),
    pytest.param(lambda: "cp.example:8080", "not an http", id="no-scheme"),
    pytest.param(lambda: "http://[::1", "not a URL", id="unparseable"),
    pytest.param(lambda: "http://cp.example:99999", "not a URL", id="port-out-of-range"),
    pytest.param(lambda: "http://cp.example:8080/?x=1", "query", id="query"),
]


@pytest.mark.parametrize(("make_url", "reason"), BAD_URLS)
def test_a_public_url_that_cannot_be_right_stops_serve_with_one_line(
    tmp_path: Path, make_url: object, reason: str
) -> None:
    public_url = make_url()  # type: ignore[operator]
    done = refused(tmp_path, free_port(), _env(tmp_path, WEIGHTSHIP_PUBLIC_URL=public_url))
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert "WEIGHTSHIP_PUBLIC_URL" in errors[0]
    assert reason in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cp.db").exists()  # refused before touching the database


def test_a_proxy_on_another_loopback_port_is_accepted_as_the_public_url(tmp_path: Path) -> None:
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        proxy_url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        env = _env(tmp_path, WEIGHTSHIP_PUBLIC_URL=proxy_url)
        with serving(tmp_path, free_port(), env) as (_url, log_path):
            assert f"public_url={proxy_url} public_url_from=WEIGHTSHIP_PUBLIC_URL" in log_path.read_text()


def test_a_port_in_use_stops_serve_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = refused(tmp_path, taken.getsockname()[1], _env(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: cannot listen on 127.0.0.1:")
    assert "Traceback" not in done.stderr


def test_the_readme_admin_token_passes_the_strength_check(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    exports = re.findall(r"^export WEIGHTSHIP_ADMIN_TOKEN=.*$", readme, flags=re.MULTILINE)
    assert exports, "the README no longer shows how to set the admin token"
    shell = subprocess.run(
        ["bash", "-c", f'{exports[0]}\nprintf %s "$WEIGHTSHIP_ADMIN_TOKEN"'],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"},
    )
    token = shell.stdout
    assert token.startswith("ws_")
    with serving(tmp_path, free_port(), _env(tmp_path, WEIGHTSHIP_ADMIN_TOKEN=token)) as (url, log_path):
        with Client(url, token) as admin:
            assert admin.whoami().role.value == "admin"
        assert "bootstrap_token_weak" not in log_path.read_text()
