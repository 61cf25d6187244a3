"""Alembic migrations of the control plane's schema; run them with ``controlplane.persistence.migrate.upgrade``."""
