"""Fixtures for the security tests, re-exported so hostile cases run against the same real processes.

From ``tests/controlplane/conftest.py``: a live control plane over HTTP on the parametrised
database, the origin-store parametrisation (local directory and moto S3) and the step-by-step
``publisher``. From ``tests/agent/conftest.py``: the agent tests' real control plane, fault proxy
and agent processes; ``cluster_cache``: a cluster cache process (with the tracker).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.conftest import controlplane, deployment, fleet, model, proxy, spawn, versions
from tests.agent.fleet import Fleet
from tests.agent.peers import start_cache
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

__all__ = [
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


@pytest.fixture
async def cluster_cache(tmp_path: Path, fleet: Fleet, model: str) -> AsyncIterator[AgentProcess]:
    """A cluster cache (which runs the tracker) on a free port, enrolled with the caches' token; stopped after."""
    process = start_cache(tmp_path, fleet, f"{model[:50]}-cache")
    await process.ready()
    await eventually(lambda: "tickets.keys_read" in process.log(), 30, "the cache to read the ticket keys")
    yield process
    await process.close()
