"""Fixtures for the security tests, re-exported so hostile cases run against the same real processes.

From ``tests/controlplane/conftest.py`` (see there): a live control plane over HTTP on the
parametrised database, the origin-store parametrisation (local directory and moto S3) and the
step-by-step ``publisher``.
"""

from __future__ import annotations

from tests.controlplane.conftest import (
    cp_client,
    cp_settings,
    cp_state,
    live_controlplane,
    origin_settings,
    publisher,
    role_headers,
)

__all__ = ["cp_client", "cp_settings", "cp_state", "live_controlplane", "origin_settings", "publisher", "role_headers"]
