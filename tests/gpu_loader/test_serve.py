"""The reference model server, run as a real process against a fake of the agent's local API."""

from __future__ import annotations

import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.gpu_loader.conftest import Versions

pytest.importorskip("pydantic", reason="the agent API schemas need pydantic")
from tests.gpu_loader.fake_local_agent import FakeLocalAgent
from tests.gpu_loader.server_process import PROMPT, REPO, ServerProcess
from tests.gpu_loader.staged_versions import manifest_of
from weightship.testing import eventually as poll_until
from weightship.testing import problem


def test_standalone_server_serves_a_version_with_metrics(versions: Versions, tmp_path: Path) -> None:
    digest = manifest_of(versions.sharded).digest
    with ServerProcess(["--version-dir", str(versions.sharded), "--verify", "full"], tmp_path) as server:
        assert poll_until(server.ready_digest, 60, "ready") == digest
        answer = server.client.post("/v1/generate", json=PROMPT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["digest"] == digest
        assert len(answer.json()["output_ids"][0]) == 2
        bad = server.client.post("/v1/generate", json={"input_ids": [[10**9]]})
        assert bad.status_code == 400
        assert problem(bad)["code"] == "invalid_request"
        status = server.client.get("/v1/status").json()
        assert {c["name"]: c["passed"] for c in status["serving"]["checks"]} == {"finite": True, "weights": True, "golden": True}
        assert server.metric('weightship_serve_requests_total{code="200"}') == 1.0
        assert server.metric('weightship_serve_requests_total{code="400"}') == 1.0
        assert server.metric(f'weightship_serve_validation_passed{{digest="{digest}"}}') == 1.0
        assert (server.metric(f'weightship_serve_load_gbps{{digest="{digest}"}}') or 0.0) > 0
        assert server.metric("weightship_serve_request_seconds_count") == 2.0
        assert server.metric("weightship_serve_queue_depth") == 0.0
        assert server.metric("weightship_serve_inflight_requests") == 0.0
        assert server.metric("weightship_serve_ready") == 1.0


def test_standalone_server_refuses_a_nan_version_and_exits(versions: Versions, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpu_loader.serve", "--version-dir", str(versions.nan), "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 1
    assert "finite: 1 of" in proc.stderr
    assert "NaN" in proc.stderr


def test_server_is_not_ready_until_the_agent_has_a_version(versions: Versions, tmp_path: Path) -> None:
    with FakeLocalAgent() as agent:
        agent.publish("chat", None, None, ready=False)
        with ServerProcess(["--agent", agent.url, "--deployment", "chat", "--poll-seconds", "5"], tmp_path) as server:
            # Listening, waiting on the agent, and honest about it.
            assert server.client.get("/readyz").status_code == 503
            assert server.client.get("/healthz").status_code == 200
            refused = server.client.post("/v1/generate", json=PROMPT)
            assert refused.status_code == 503
            assert problem(refused)["code"] == "not_ready"
            digest = manifest_of(versions.single).digest
            agent.publish("chat", digest, str(versions.single))
            assert poll_until(server.ready_digest, 60, "ready") == digest


def test_switch_swaps_versions_without_failing_a_request(versions: Versions, tmp_path: Path) -> None:
    first, second = manifest_of(versions.sharded).digest, manifest_of(versions.variant).digest
    with FakeLocalAgent() as agent:
        agent.publish("chat", first, str(versions.sharded))
        with ServerProcess(["--agent", agent.url, "--deployment", "chat", "--poll-seconds", "5"], tmp_path) as server:
            assert poll_until(server.ready_digest, 60, "first version ready") == first
            seen: list[list[tuple[int, str | None]]] = [[], []]
            stop = threading.Event()

            def hammer(out: list[tuple[int, str | None]]) -> None:
                with httpx.Client(base_url=str(server.client.base_url), timeout=30) as client:
                    while not stop.is_set():
                        response = client.post("/v1/generate", json=PROMPT)
                        out.append((response.status_code, response.json().get("digest")))

            threads = [threading.Thread(target=hammer, args=(out,)) for out in seen]
            for thread in threads:
                thread.start()
            try:
                poll_until(lambda: all(len(out) >= 3 for out in seen), 60, "requests on the first version")
                agent.publish("chat", second, str(versions.variant))
                poll_until(lambda: all(out[-1][1] == second for out in seen if out), 60, "requests on the second version")
                answered = sum(len(out) for out in seen)
                poll_until(lambda: sum(len(out) for out in seen) >= answered + 4, 60, "more requests on the second version")
            finally:
                stop.set()
                for thread in threads:
                    thread.join(timeout=60)
            for out in seen:
                assert {code for code, _ in out} == {200}
                digests = [d for _, d in out]
                switch = digests.index(second)
                assert set(digests[:switch]) == {first}
                assert set(digests[switch:]) == {second}  # never back to the old version
            reports = poll_until(lambda: agent.reports_for(second), 30, "the second version's report")
            assert reports[0].passed
            assert {c.name for c in reports[0].checks} == {"load", "finite", "weights", "golden"}
            assert reports[0].load_gbps > 0
            assert agent.reports_for(first)[0].passed
            assert server.metric("weightship_serve_swaps_total") == 1.0
            poll_until(lambda: "serve.retired" in server.log(), 30, "the old version to be freed")


def test_bad_versions_fail_validation_and_the_good_one_keeps_serving(versions: Versions, tmp_path: Path) -> None:
    good = manifest_of(versions.single).digest
    with FakeLocalAgent() as agent:
        agent.publish("chat", good, str(versions.single))
        with ServerProcess(["--agent", agent.url, "--deployment", "chat", "--poll-seconds", "5"], tmp_path) as server:
            assert poll_until(server.ready_digest, 60, "good version ready") == good
            for bad_version, failing in ((versions.nan, {"finite", "golden"}), (versions.noise, {"golden"})):
                bad = manifest_of(bad_version).digest
                agent.publish("chat", bad, str(bad_version))
                report = poll_until(partial(agent.reports_for, bad), 60, "the bad version's report")[0]
                assert not report.passed
                assert {c.name for c in report.checks if not c.passed} == failing
                assert server.ready_digest() == good
                answer = server.client.post("/v1/generate", json=PROMPT)
                assert answer.status_code == 200
                assert answer.json()["digest"] == good
                assert server.metric(f'weightship_serve_validation_passed{{digest="{bad}"}}') == 0.0
            assert server.metric("weightship_serve_swaps_total") == 0.0


@pytest.mark.parametrize("body", [b"not json", b'{"input_ids": []}', b'{"input_ids": [[1], [1, 2]]}', b'{"input_ids": [[1]], "max_new_tokens": 1000}'])
def test_generate_rejects_malformed_requests(body: bytes) -> None:
    from gpu_loader.serve import _BadRequest, _parse_generate

    with pytest.raises(_BadRequest):
        _parse_generate(body)
