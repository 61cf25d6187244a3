"""Fixtures for the security tests, re-exported so hostile cases run against the same real processes.

From ``tests/controlplane/conftest.py``: a live control plane over HTTP on the parametrised
database, the origin-store parametrisation (local directory and moto S3) and the step-by-step
``publisher``. From ``tests/agent/conftest.py``: the agent tests' real control plane, fault proxy
and agent processes; ``cluster_cache``: a cluster cache process (with the tracker).
"""

from __future__ import annotations

from tests.agent.conftest import cluster_cache, controlplane, deployment, fleet, model, proxy, spawn, versions
from tests.controlplane.conftest import (
    cp_client,
    cp_settings,
    cp_state,
    live_controlplane,
    origin_settings,
    publisher,
    role_headers,
    seed_versions,
)
from tests.security.ticket_parts import fleet_state as fleet_state  # a fixture for every test below this folder

__all__ = [
    "cluster_cache",
    "controlplane",
    "cp_client",
    "cp_settings",
    "cp_state",
    "deployment",
    "fleet",
    "live_controlplane",
    "model",
    "origin_settings",
    "proxy",
    "publisher",
    "role_headers",
    "seed_versions",
    "spawn",
    "versions",
]
