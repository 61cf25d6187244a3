"""The one-step install, with real processes: what the chart's bootstrap Secret and its `helm test` hook do.

The chart renders (Helm's own engine, the docs' release and namespace) a bootstrap Secret of random
tokens. Its contents are laid out as files the way the kubelet mounts the Secret, and then:

- a real control plane, started with ``WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR`` as the chart sets it,
  stores only the tokens' hashes and accepts them;
- a real agent enrols with the ``agent`` token from the file the chart mounts into its pod;
- a real operator process (kmock as its API server) runs with the ``operator`` token and the
  liveness endpoint the chart configures;
- the chart's own ``helm test`` script, run with the test pod's environment, passes against them,
  and fails naming the operator when the operator is gone.

Plus the agent's start-up check of its quota against the disk, on a real agent process.
"""

from __future__ import annotations

import base64
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.config import check_disk, load_config
from controlplane.auth import hash_secret
from controlplane.k8s.operator import OperatorConfig
from controlplane.k8s.replicasets import build_replicaset
from controlplane.k8s.rollout import parse_rollout
from controlplane.tokens import read_bootstrap_dir
from tests.agent.agent_processes import AgentProcess
from tests.agent.controlplane_process import ControlPlaneProcess
from tests.kubernetes.chart_parts import DATA_DIR, REPO, REQUIRED, find, merged, objects
from tests.kubernetes.conftest import OperatorProcess, VersionedEmulator
from tests.kubernetes.rollout_parts import rollout
from weightship.errors import ValidationError
from weightship.schemas import Role
from weightship.testing import eventually_async, free_port

ROLES = ("admin", "agent", "operator")


def mount_secret(secret: dict[str, Any], directory: Path, items: dict[str, str]) -> Path:
    """``secret``'s ``items`` (key -> path) as the kubelet mounts them: files behind ``..data`` links."""
    timestamped = directory / "..2026_12_03_09_00_00.000000001"
    timestamped.mkdir(parents=True)
    for key, path in items.items():
        (timestamped / path).write_bytes(base64.b64decode(secret["data"][key]))
    (directory / "..data").symlink_to(timestamped.name)
    for path in items.values():
        (directory / path).symlink_to(f"..data/{path}")
    return directory


def volume_items(pod: dict[str, Any], volume: str) -> dict[str, str]:
    (found,) = [v for v in pod["volumes"] if v["name"] == volume]
    return {i["key"]: i["path"] for i in found["secret"]["items"]}


@pytest.fixture
def chart() -> list[tuple[str, dict[str, Any]]]:
    return objects(REQUIRED)


@pytest.fixture
def bootstrap(chart: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """The bootstrap Secret's tokens, decoded."""
    secret = find(chart, "Secret", "-bootstrap")
    return {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}


@pytest.fixture
def controlplane(
    chart: list[tuple[str, dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ControlPlaneProcess]:
    """A control plane with the bootstrap Secret mounted as the chart's Deployment mounts it."""
    pod = find(chart, "Deployment", "-controlplane")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "bootstrap"]
    assert env["WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR"] == mount["mountPath"]
    secret = find(chart, "Secret", "-bootstrap")
    directory = mount_secret(secret, tmp_path / "bootstrap", volume_items(pod, "bootstrap"))
    monkeypatch.setenv("WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR", str(directory))
    cp = ControlPlaneProcess(tmp_path / "cp")
    cp.start()
    yield cp
    cp.stop()


def helm_test(
    chart: list[tuple[str, dict[str, Any]]], tmp_path: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The chart's `helm test` pod's command, with its environment and ``env`` (local URLs, the token)."""
    script = tmp_path / "helm-test.py"
    script.write_text(find(chart, "ConfigMap", "-test")["data"]["helm-test.py"])
    pod = find(chart, "Pod", "-test")["spec"]
    plain = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}
    return subprocess.run(
        [sys.executable, str(script)],
        env={"PATH": os.environ.get("PATH", ""), **plain, "WEIGHTSHIP_TEST_INTERVAL": "0.2", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(180)
async def test_bootstrap_tokens_let_agent_and_operator_in_and_helm_test_passes(
    chart: list[tuple[str, dict[str, Any]]],
    bootstrap: dict[str, str],
    controlplane: ControlPlaneProcess,
    kmock_server: VersionedEmulator,
    tmp_path: Path,
) -> None:
    await controlplane.ready()

    # Stored hashed: each token's SHA-256 is there as bootstrap-<role>, the token itself nowhere.
    with sqlite3.connect(controlplane.database) as db:
        rows = dict(db.execute("SELECT name, secret_hash FROM tokens WHERE created_by = 'bootstrap'").fetchall())
    db.close()
    for role in ROLES:
        assert rows[f"bootstrap-{role}"] == hash_secret(bootstrap[role])
    stored = b"".join(p.read_bytes() for p in controlplane.workdir.glob("cp.db*"))
    assert not [role for role in ROLES if bootstrap[role].encode() in stored]

    # The agent enrols with the token file its pod gets.
    daemonset = find(chart, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    enrolment = mount_secret(
        find(chart, "Secret", "-bootstrap"), tmp_path / "enrolment", volume_items(daemonset, "enrolment")
    )
    agent = AgentProcess(
        tmp_path, "gpu-1", controlplane.url, token="", deployments=(), extra=["--token-file", str(enrolment / "token")]
    )
    agent.start()
    try:
        await agent.ready()
        operator_headers = {"Authorization": f"Bearer {bootstrap['operator']}"}
        async with httpx.AsyncClient(base_url=controlplane.url, headers=operator_headers, timeout=10) as http:

            async def enrolled() -> bool:
                nodes = (await http.get("/v1/nodes")).raise_for_status().json()
                return any(n["name"] == "gpu-1" and not n["stale"] for n in nodes)

            await eventually_async(enrolled, 60, "agent gpu-1 to enrol with the bootstrap token")

        # The operator, as the chart runs it: the bootstrap token and kopf's liveness endpoint.
        health = free_port()
        operator = OperatorProcess(kmock_server, controlplane.url, bootstrap["operator"], "op-1", tmp_path / "op.log")
        operator.env["WEIGHTSHIP_OPERATOR_LIVENESS"] = f"http://127.0.0.1:{health}/healthz"
        deployment = find(chart, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "WEIGHTSHIP_OPERATOR_LIVENESS", "value": "http://0.0.0.0:8081/healthz"} in deployment["env"]
        operator.start()
        try:
            local = {
                "WEIGHTSHIP_URL": controlplane.url,
                "WEIGHTSHIP_TOKEN": bootstrap["operator"],
                "WEIGHTSHIP_TEST_OPERATOR_URL": f"http://127.0.0.1:{health}/healthz",
                "WEIGHTSHIP_TEST_TIMEOUT": "60",
            }
            passed = helm_test(chart, tmp_path, local)
            assert passed.returncode == 0, passed.stderr + operator.log()[-2000:]
            for check in ("control plane ready", "operator token accepted", "agent enrolled", "operator alive"):
                assert f"ok: {check}" in passed.stdout
        finally:
            operator.stop()

        # With the operator gone, `helm test` fails and says what it waited for.
        failed = helm_test(chart, tmp_path, {**local, "WEIGHTSHIP_TEST_TIMEOUT": "1"})
        assert failed.returncode == 1
        assert "FAILED: operator alive" in failed.stderr
        assert f"127.0.0.1:{health}/healthz" in failed.stderr
        # A token that is not a bootstrap one is refused: the check proves the token, not just the route.
        refused = helm_test(
            chart, tmp_path, {**local, "WEIGHTSHIP_TOKEN": "ws_not-a-token", "WEIGHTSHIP_TEST_TIMEOUT": "1"}
        )
        assert "FAILED: operator token accepted" in refused.stderr
    finally:
        await agent.close()


@pytest.mark.timeout(60)
def test_agent_refuses_a_quota_larger_than_its_disk(tmp_path: Path) -> None:
    data = tmp_path / "data" / "not-yet-made"  # measured on the filesystem it will be made on
    total = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    argv = [sys.executable, "-m", "agent", "--control-plane", "http://127.0.0.1:9", "--name", "gpu-1"]
    argv += ["--data-dir", str(data), "--quota", str(total + 1024**3)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 2
    assert "larger than the filesystem holding data_dir" in done.stderr
    assert "lower --quota" in done.stderr
    assert "agent.quota" in done.stderr
    assert not data.exists()  # refused before anything was written

    fits = load_config(
        ["--control-plane", "http://cp", "--name", "gpu-1", "--data-dir", str(data), "--quota", "1MiB"], {}
    )
    check_disk(fits)  # no error
    with_reserve = load_config(
        ["--control-plane", "http://cp", "--name", "gpu-1", "--data-dir", str(data), "--quota", str(total // 2 + 1),
         "--min-free", str(total // 2 + 1)],
        {},
    )  # fmt: skip
    with pytest.raises(Exception, match="plus min_free"):
        check_disk(with_reserve)


@pytest.mark.timeout(120)
async def test_a_revoked_bootstrap_token_stays_revoked_across_restarts(
    bootstrap: dict[str, str], controlplane: ControlPlaneProcess
) -> None:
    await controlplane.ready()
    admin = {"Authorization": f"Bearer {bootstrap['admin']}"}
    agent = {"Authorization": f"Bearer {bootstrap['agent']}"}
    async with httpx.AsyncClient(base_url=controlplane.url, timeout=10) as http:
        tokens = (await http.get("/v1/tokens", headers=admin)).raise_for_status().json()
        (enrolment,) = [t for t in tokens if t["name"] == "bootstrap-agent"]
        assert enrolment["role"] == "agent"
        assert enrolment["node_id"] is None  # an enrolment token: it can enrol a node, not act for one
        assert (await http.delete(f"/v1/tokens/{enrolment['id']}", headers=admin)).status_code == 204
    controlplane.stop()
    controlplane.start()  # the same Secret mounted again, as after a rollout of the Deployment
    await controlplane.ready()
    async with httpx.AsyncClient(base_url=controlplane.url, timeout=10) as http:
        assert (await http.get("/v1/nodes", headers=agent)).status_code == 401
        assert (await http.get("/v1/nodes", headers=admin)).status_code == 200


def test_a_missing_bootstrap_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR names .*not a directory"):
        read_bootstrap_dir(str(tmp_path / "absent"))
    (tmp_path / "operator").write_text("  ws_operator-token-0123456789  \n")
    (tmp_path / "agent").write_text("\n")  # empty: ignored, with a warning
    (tmp_path / "url-signing-key").write_text("not a token")  # not a role: not read
    assert read_bootstrap_dir(str(tmp_path)) == [(Role.operator, "ws_operator-token-0123456789")]
    assert read_bootstrap_dir("") == []


@pytest.mark.timeout(60)
def test_a_pods_waiter_gives_up_at_the_charts_deadline_naming_what_it_waited_for(tmp_path: Path) -> None:
    values = merged(REQUIRED, {"operator": {"waitDeadlineSeconds": 1}})
    operator = find(objects(values), "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    config = OperatorConfig.from_env({e["name"]: e["value"] for e in operator["env"] if "value" in e})
    assert config.wait_deadline == 1
    digest = "sha256:" + "ab" * 32
    replicaset = build_replicaset(
        rollout="chat", namespace="models", uid=None, spec=parse_rollout(rollout("v2", [])["spec"]), digest=digest,
        role="canary", replicas=1, wait_image=config.wait_image, paths=config.agent_paths,
        wait_deadline=config.wait_deadline,
    )  # fmt: skip
    (waiter,) = replicaset["spec"]["template"]["spec"]["initContainers"]
    (server,) = replicaset["spec"]["template"]["spec"]["containers"]
    versions = {"name": "WEIGHTSHIP_VERSIONS_DIR", "value": f"{DATA_DIR}/versions"}  # the chart's default, told to the server
    assert versions in server["env"]
    env = {e["name"]: e["value"] for e in waiter["env"] if "value" in e}
    assert env["WEIGHTSHIP_WAIT_DEADLINE"] == "1"
    env["WEIGHTSHIP_AGENT_URL"] = f"unix:{tmp_path / 'agent.sock'}"  # no agent on this "node"
    done = subprocess.run(
        [sys.executable, *waiter["command"][1:]],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"waiter.gave_up digest={digest} deployment=chat-prod agent=unix:{tmp_path / 'agent.sock'}" in done.stdout
    assert "waited=1s" in done.stdout
    # The default never hangs either: the chart always sets a deadline.
    default = find(objects(REQUIRED), "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "WEIGHTSHIP_OPERATOR_WAIT_DEADLINE", "value": "1800"} in default["env"]


@pytest.mark.timeout(120)
async def test_a_cache_enrols_with_the_charts_cache_token_and_the_nodes_token_enrols_no_cache(
    chart: list[tuple[str, dict[str, Any]]], bootstrap: dict[str, str], controlplane: ControlPlaneProcess, tmp_path: Path
) -> None:
    await controlplane.ready()
    # What the cache pods mount (caches enabled), from the Secret the control plane got its hashes from.
    with_caches = objects(merged(REQUIRED, {"caches": {"enabled": True}}))
    items = volume_items(find(with_caches, "StatefulSet", "-cache-cluster")["spec"]["template"]["spec"], "enrolment")
    assert items == {"cache": "token"}
    enrolment = mount_secret(find(chart, "Secret", "-bootstrap"), tmp_path / "enrolment", items)
    cache = AgentProcess(tmp_path, "cache-0", controlplane.url, token="", deployments=(),
                         extra=["--role", "cache", "--peer-listen", "127.0.0.1:0",
                                "--token-file", str(enrolment / "token")])  # fmt: skip
    cache.start()
    try:
        await cache.ready()
        async with httpx.AsyncClient(base_url=controlplane.url, timeout=10) as http:
            operator = {"Authorization": f"Bearer {bootstrap['operator']}"}

            async def enrolled() -> bool:
                nodes = (await http.get("/v1/nodes", headers=operator)).raise_for_status().json()
                return any(n["name"] == "cache-0" and n["role"] == "cache" for n in nodes)

            await eventually_async(enrolled, 60, "cache-0 to enrol with the chart's cache token")
            # The nodes' token cannot make a cache: the role is bound to the token minted for it.
            sneaky = await http.post("/v1/nodes/enrol", json={"name": "fake-cache", "role": "cache"},
                                     headers={"Authorization": f"Bearer {bootstrap['agent']}"})  # fmt: skip
            assert sneaky.status_code == 403, sneaky.text
    finally:
        await cache.close()

