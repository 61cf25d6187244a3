"""Alembic migrations: the migrated schema is exactly ``db.py``'s, upgrades are idempotent and safe
when several replicas start together, and ``weightship-controlplane migrate`` / ``serve`` work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from controlplane.__main__ import main
from controlplane.persistence import migrate
from controlplane.persistence.engine import make_engine
from controlplane.persistence.rows import Base
from weightship.testing import eventually

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """An engine on a fresh, empty database (SQLite or PostgreSQL)."""
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def schema_differences(engine: Engine) -> list[object]:
    """What autogenerate would change to make the database match ``Base.metadata``."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        return list(compare_metadata(context, Base.metadata))


def test_migrated_schema_matches_the_models_exactly(engine: Engine) -> None:
    migrate.upgrade(engine)
    assert schema_differences(engine) == []
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert set(inspect(engine).get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}


def test_upgrading_twice_changes_nothing(engine: Engine) -> None:
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO models (name, allow_pickle, created_at) VALUES ('m', false, CURRENT_TIMESTAMP)"))
    migrate.upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM models")).scalars().all() == ["m"]
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1


def test_downgrade_to_base_removes_everything_and_upgrade_rebuilds_it(engine: Engine) -> None:
    migrate.upgrade(engine)
    migrate.downgrade(engine, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    assert migrate.current_revision(engine) is None
    migrate.upgrade(engine)
    assert schema_differences(engine) == []


def test_replicas_migrating_at_once_all_succeed_and_migrate_once(database_url: str) -> None:
    replicas = 4
    engines = [make_engine(database_url) for _ in range(replicas)]
    try:
        with ThreadPoolExecutor(max_workers=replicas) as pool:
            list(pool.map(migrate.upgrade, engines))  # re-raises the first failure
        assert schema_differences(engines[0]) == []
        with engines[0].connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [
                migrate.head_revision()
            ]
    finally:
        for engine in engines:
            engine.dispose()


def test_migrate_command_brings_an_empty_database_to_head(
    database_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_DATABASE_URL", database_url)
    assert main(["migrate", "--show"]) == 0
    assert "empty -> empty" in capsys.readouterr().out
    assert inspect(engine).get_table_names() == []
    assert main(["migrate"]) == 0
    assert f"empty -> {migrate.head_revision()}" in capsys.readouterr().out
    assert schema_differences(engine) == []


def test_serve_command_migrates_at_start_and_serves_the_api(tmp_path: Path) -> None:
    # A real process through the real entry point; the database kind is covered above.
    database_url = f"sqlite:///{tmp_path / 'serve.db'}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = "ws_serve-test-admin-0123456789"
    env = {
        **os.environ,
        "WEIGHTSHIP_DATABASE_URL": database_url,
        "WEIGHTSHIP_STORE": f"local:{tmp_path / 'origin'}",
        "WEIGHTSHIP_ADMIN_TOKEN": token,
    }
    command = [sys.executable, "-m", "controlplane", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            def ready() -> bool:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
                return client.get("/readyz").status_code == 200

            eventually(ready, 60, "the control plane to become ready", not_yet=(httpx.TransportError,))
            response = client.get("/v1/tokens", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 200
            assert [t["role"] for t in response.json()] == ["admin"]
        engine = make_engine(database_url)
        try:
            assert schema_differences(engine) == []
        finally:
            engine.dispose()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
