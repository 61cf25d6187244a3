"""Schema migrations: bring a database to the newest Alembic revision, safely from many replicas.

The control plane calls ``upgrade(engine)`` at start-up, and ``weightship-controlplane migrate``
does the same from the command line. Several replicas may start at once against one database,
so the whole upgrade runs in one transaction that first takes a lock:

- PostgreSQL: ``pg_advisory_xact_lock`` (released at commit); DDL is transactional, so a failed
  migration leaves nothing behind.
- SQLite: ``BEGIN IMMEDIATE`` takes the database's write lock before Alembic reads its version
  table, so a second process waits (busy timeout) and then finds the schema already at head.

The revisions live in ``controlplane/persistence/migrations/versions``; ``controlplane/persistence/rows.py`` must match the
newest one (``tests/controlplane/test_migrations.py`` compares them on both databases).
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import exc, text
from sqlalchemy.engine import Connection, Engine

from weightship.backoff import Backoff
from weightship.errors import TemporaryError
from weightship.logs import event

__all__ = ["MIGRATIONS_DIR", "alembic_config", "current_revision", "downgrade", "head_revision", "upgrade"]

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

#: arbitrary constant naming the advisory lock that serialises migrations on PostgreSQL
_PG_LOCK_KEY = 0x77_73_6D_69_67  # "wsmig"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic ``Config`` for our migrations, optionally bound to an open connection."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision the code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migration revisions found under {MIGRATIONS_DIR}")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; ``None`` for an empty database."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


#: how long a migration may wait for another replica's (the engine's own lock timeout is seconds)
_MIGRATION_LOCK_WAIT_MS = 120_000


def _lock(conn: Connection) -> None:
    # The engine bounds lock waits to a few seconds so requests fail fast; a replica waiting for
    # another replica's migration must wait longer, for this transaction only.
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = {_MIGRATION_LOCK_WAIT_MS}")
        conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
    elif conn.dialect.name == "sqlite":
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {_MIGRATION_LOCK_WAIT_MS}")
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class _Locked(TemporaryError):
    """SQLite's "database is locked" during a migration: a start-up race that passes (retried)."""


def _migrate(engine: Engine, target: str, *, down: bool) -> None:
    # SQLite answers "database is locked" at once when replicas start together and race to switch the
    # new file to WAL mode, before its busy timeout applies; that race passes, so try a few times.
    backoff = Backoff(attempts=8 if engine.dialect.name == "sqlite" else 1, base=0.1, cap=6.4)

    def once() -> tuple[str | None, str | None]:
        try:
            return _migrate_once(engine, target, down=down)
        except exc.OperationalError as err:
            message = (
                f"could not migrate the database at {engine.url.render_as_string(hide_password=True)}: {err.orig}; "
                "check that it is reachable and not locked by another process, then retry"
            )
            if "locked" in str(err.orig):
                raise _Locked(message, delay=0.0) from err
            raise TemporaryError(message, delay=5.0) from err

    try:
        before, after = backoff.run(once, retryable=lambda error: isinstance(error, _Locked))
    except _Locked as locked:
        raise TemporaryError(locked.message, delay=5.0) from locked.__cause__
    if before != after:
        event(log, "schema.migrated", **{"from": before, "to": after, "dialect": engine.dialect.name})


def _restore_busy_timeout(conn: Connection, busy_ms: int) -> None:
    """Give the connection the engine's own bound back before it returns to the pool."""
    try:
        conn.rollback()  # a no-op after commit; after a failure, ends the transaction first
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {busy_ms}")
    except exc.SQLAlchemyError:
        conn.invalidate()  # never pool a connection that would wait minutes for a lock


def _migrate_once(engine: Engine, target: str, *, down: bool) -> tuple[str | None, str | None]:
    with engine.connect() as conn:
        busy_ms = conn.exec_driver_sql("PRAGMA busy_timeout").scalar() if conn.dialect.name == "sqlite" else None
        try:
            _lock(conn)
            before = MigrationContext.configure(conn).get_current_revision()
            config = alembic_config(conn)
            if down:
                command.downgrade(config, target)
            else:
                command.upgrade(config, target)
            after = MigrationContext.configure(conn).get_current_revision()
            conn.commit()
        finally:
            if busy_ms is not None:
                _restore_busy_timeout(conn, int(busy_ms))
    return before, after


def upgrade(engine: Engine, target: str = "head") -> None:
    """Bring the schema to ``target`` (default: the newest revision); a no-op when already there."""
    _migrate(engine, target, down=False)


def downgrade(engine: Engine, target: str) -> None:
    """Revert the schema to ``target`` (``"base"`` drops everything); for tests and operators."""
    _migrate(engine, target, down=True)
