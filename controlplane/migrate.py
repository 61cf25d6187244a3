"""Schema migrations (being written: Alembic). For now: create tables."""

from sqlalchemy.engine import Engine

from controlplane.db import Base


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest version."""
    Base.metadata.create_all(engine)
