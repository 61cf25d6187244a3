"""`make demo` as part of `make test`: the whole story on a small model, checked from its JSON line.

Two agents, and the canary step moves 50 % of them (node-1 falls in it; node-0 never does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


@pytest.fixture(scope="module")
def demo_figures() -> dict[str, object]:
    """One small demo run (2 agents, 8 MB), its closing JSON line."""
    # Its own session, so that a demo past its time is stopped with every process it started
    # (the demo stops its children itself only when it gets to its ``finally``).
    with subprocess.Popen(
        [sys.executable, "demo/demo.py", "--size-mb", "8", "--agents", "2", "--canary-weight", "50"],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as demo:
        try:
            stdout, stderr = demo.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            stdout, stderr = demo.communicate()
            pytest.fail(f"the demo took over 600 s:\n{stdout[-4000:]}\n{stderr[-4000:]}")
    assert demo.returncode == 0, f"the demo failed:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict)
    return figures


def test_demo_hot_swaps_under_traffic_and_rolls_back_without_downloading(demo_figures: dict[str, object]) -> None:
    figures: dict[str, Any] = demo_figures
    assert figures["versions_published"] == 3
    assert figures["agents"] == 2
    assert figures["serve_requests"] > 0
    assert figures["serve_failed_requests"] == 0
    assert figures["rollback_bytes_downloaded"] == 0
    assert figures["v2_switch_bytes_downloaded"] > 0
    seen = figures["serve_versions_seen"]
    assert len(seen) == 3, f"expected v1, v2, then v1 again; saw {seen}"
    v1, v2, back = seen
    assert v1 != v2, "the server never answered with v2 before the rollback"
    assert back == v1, "after the rollback the server must answer with v1 again"


def test_demo_fetches_through_the_cluster_cache_and_peers_with_v1_from_the_origin_about_once(
    demo_figures: dict[str, object],
) -> None:
    figures: dict[str, Any] = demo_figures
    assert {"origin_bytes", "peer_bytes", "cache_bytes"} <= figures.keys()
    assert figures["cache_bytes"] > 0  # nodes fetched through the cache
    # each of the two agents received all of v1 over the network, from the cache or a peer
    assert figures["cache_bytes"] + figures["peer_bytes"] >= 2 * figures["v1_bytes"]
    v1_bytes, v1_origin = figures["v1_bytes"], figures["v1_origin_bytes"]
    # two agents, one copy of v1 out of the origin (the cache's read-through and read-ahead)
    assert v1_bytes <= v1_origin <= 1.1 * v1_bytes, (v1_origin, v1_bytes)
    assert figures["origin_bytes"] >= v1_origin


def test_demo_promotes_the_good_version_and_rolls_the_broken_one_back_by_itself(
    demo_figures: dict[str, object],
) -> None:
    figures: dict[str, Any] = demo_figures
    outcomes = [(r["version"], r["phase"]) for r in figures["rollouts"]]
    assert outcomes == [("v1", "Healthy"), ("v2", "Healthy"), ("v3", "Degraded")], outcomes
    assert 0 < figures["canary_max_share"] <= 0.5, "the canary never exceeded its step's share of the nodes"
    assert figures["auto_rollback_bytes_downloaded"] == 0
    assert 0 <= figures["auto_rollback_seconds"] < 30
    # v3 failed validation on its canary: no model server ever answered with it
    v1, v2, _ = figures["serve_versions_seen"]
    assert sorted(figures["serve_versions_answered"]) == sorted({v1, v2})


def test_demo_signs_its_versions_and_every_node_refuses_a_tampered_unsigned_one(demo_figures: dict[str, object]) -> None:
    figures: dict[str, Any] = demo_figures
    assert figures["signed_versions"] == figures["versions_published"]
    assert figures["unsigned_refused"] is True
