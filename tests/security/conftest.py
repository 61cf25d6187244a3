"""Fixtures for the security tests: the agent tests' real control plane, fault proxy and agent processes.

Re-exported from ``tests/agent/conftest.py`` (see there) so that hostile cases live in one folder
and run against exactly the same real processes as the agent's own tests.
"""

from __future__ import annotations

from tests.agent.conftest import controlplane, deployment, fleet, model, proxy, spawn, versions

__all__ = ["controlplane", "deployment", "fleet", "model", "proxy", "spawn", "versions"]
