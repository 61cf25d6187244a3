"""Alembic environment: runs migrations on the connection ``controlplane.persistence.migrate`` hands over.

``controlplane.persistence.migrate.upgrade`` puts an open connection (inside a transaction that already holds
the migration lock) into ``config.attributes["connection"]``; the migrations then run inside that
transaction. Without one (the ``alembic`` command line, for developers), the URL comes from
``sqlalchemy.url`` or ``WEIGHTSHIP_DATABASE_URL``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from controlplane.persistence.engine import make_engine
from controlplane.persistence.rows import Base
from controlplane.settings import Settings

target_metadata = Base.metadata


def _database_url() -> str:
    return context.config.get_main_option("sqlalchemy.url") or Settings().database_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """Emit SQL to stdout instead of running it (``alembic upgrade --sql``)."""
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    """Run against the handed-over connection, or one opened here."""
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_database_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
