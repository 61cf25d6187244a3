"""Fixtures shared by the whole suite: real servers started as processes, and test models.

- ``s3_server``: moto's S3 server as a separate process over HTTP (session-wide).
- ``s3_bucket``: a fresh bucket on it per test.
- ``database_url``: parametrised over SQLite and the PostgreSQL server ``make test`` starts
  (``WEIGHTSHIP_TEST_PG_URL``); every test gets a fresh, empty database. Without the variable
  the PostgreSQL half is skipped (run ``make test`` to include it).
- ``make_model``: writes a small real safetensors model directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightship.testing import free_port, wait_for_port

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server running as its own process."""
    port = free_port()
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "65536"}
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_for_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty bucket on the moto server; credentials set in the environment."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"ws-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh empty database: SQLite file, or a new database on the test PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'controlplane.db'}"
        return
    base = os.environ.get("WEIGHTSHIP_TEST_PG_URL")
    if not base:
        pytest.skip("WEIGHTSHIP_TEST_PG_URL is not set; `make test` starts PostgreSQL and sets it")
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    plain = base.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield base.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


ModelMaker = Callable[..., Path]


@pytest.fixture
def make_model(tmp_path: Path) -> ModelMaker:
    """``make_model(name, tensors_mb=1.0, seed=0, shards=1, extra_files=None)`` -> model dir.

    Writes a llama-style layout (config.json, safetensors shards, index when sharded) with
    deterministic float32 values. Equal seeds give byte-identical files.
    """

    def make(
        name: str = "model",
        tensors_mb: float = 1.0,
        seed: int = 0,
        shards: int = 1,
        extra_files: dict[str, bytes] | None = None,
    ) -> Path:
        root = tmp_path / name
        root.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        per_shard = max(1, int(tensors_mb * 1024 * 1024 / 4 / shards / 2))
        side = max(1, int(per_shard**0.5))
        weight_map: dict[str, str] = {}
        for shard in range(shards):
            fname = "model.safetensors" if shards == 1 else f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            tensors = {
                f"model.layers.{shard}.self_attn.q_proj.weight": rng.standard_normal((side, side), dtype=np.float32),
                f"model.layers.{shard}.mlp.up_proj.weight": rng.standard_normal((side, side), dtype=np.float32),
                f"model.layers.{shard}.input_layernorm.weight": np.ones(side, dtype=np.float32),
            }
            save_file(tensors, str(root / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))
        if shards > 1:
            index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
            (root / "model.safetensors.index.json").write_text(json.dumps(index))
        (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": side}))
        for rel, data in (extra_files or {}).items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        return root

    return make
