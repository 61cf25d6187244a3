"""A control plane as a process and models published to it, for the CLI's end-to-end tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from weightship.cli import app
from weightship.testing import free_port, serve_in_thread

ADMIN = "ws_admin_e2e_bootstrap_token"


CHUNK = "64KiB"


@dataclass
class ControlPlane:
    """A running control plane and a way to run the CLI against it."""

    url: str
    store: str

    def cli(self, *args: str, token: str = ADMIN) -> Result:
        env = {"WEIGHTSHIP_URL": self.url, "WEIGHTSHIP_TOKEN": token, "COLUMNS": "200"}
        return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)

    def json(self, *args: str, token: str = ADMIN) -> Any:
        result = self.cli("--json", *args, token=token)
        assert result.exit_code == 0, f"weightship {' '.join(args)} failed: {result.stderr}"
        return json.loads(result.stdout)

    def token(self, name: str, role: str) -> str:
        secret = self.json("token", "create", name, "--role", role)["token"]
        assert isinstance(secret, str)
        return secret


def _serve(settings: Any, port: int) -> Iterator[str]:
    from controlplane.app import create_app

    with serve_in_thread(create_app(settings), port=port, ws="none") as url:
        yield url


@pytest.fixture(params=["local", "s3"])
def controlplane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ControlPlane]:
    """The real control plane on SQLite, with a local-directory or an S3 (moto) origin store."""
    from controlplane.settings import Settings

    endpoint = ""
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_server")
        store = f"s3://{request.getfixturevalue('s3_bucket')}?min_part_size=65536"
    else:
        store = f"local:{tmp_path / 'origin'}"
    port = free_port()
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        store_url=store,
        s3_endpoint_url=endpoint,
        admin_token=ADMIN,
        public_url=f"http://127.0.0.1:{port}",
    )
    for url in _serve(settings, port):
        yield ControlPlane(url=url, store=request.param)


@pytest.fixture
def models(make_model: Any) -> dict[str, Path]:
    """v1, v2 (v1 with a changed tokenizer: every weight file shared) and an unrelated model."""
    return {
        "v1": make_model("v1", tensors_mb=0.5, seed=1, shards=2, extra_files={"tokenizer.json": b'{"v": 1}'}),
        "v2": make_model("v2", tensors_mb=0.5, seed=1, shards=2, extra_files={"tokenizer.json": b'{"v": 2, "x": 0}'}),
        "other": make_model("other", tensors_mb=0.3, seed=9),
    }


def _publish(cp: ControlPlane, path: Path, label: str, token: str, model: str = "llama") -> Any:
    return cp.json("publish", str(path), "--model", model, "--label", label, "--chunk-size", CHUNK, token=token)
