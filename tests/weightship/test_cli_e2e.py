"""The ``weightship`` CLI end to end, against the real control plane served over HTTP.

Each test starts ``controlplane.app.create_app`` under uvicorn on a loopback port (SQLite and
either the local-directory store or S3 on the moto server), then drives it with the CLI exactly
as a person or a script would: tokens from the environment, ``--json`` for what the test reads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from tests.weightship.cli_parts import ADMIN, CHUNK, ControlPlane, _publish
from weightship.backoff import Backoff
from weightship.cli import app
from weightship.client import Client
from weightship.errors import TemporaryError
from weightship.schemas import (
    DeploymentState,
    NodeCounters,
    NodeEnrolRequest,
    NodeHeartbeat,
    NodeLabels,
    VersionInventory,
    VersionState,
)
from weightship.testing import free_port

pytestmark = pytest.mark.timeout(90)


def test_publish_deploy_roll_back_and_read_the_history(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    publisher = cp.token("ci", "publisher")
    operator = cp.token("oncall", "operator")

    v1 = _publish(cp, models["v1"], "v1", publisher)
    assert v1["bytes_uploaded"] == v1["bytes_total"] > 0
    assert v1["bytes_deduplicated"] == 0
    v2 = _publish(cp, models["v2"], "v2", publisher)
    assert v2["bytes_uploaded"] == len(b'{"v": 2, "x": 0}')  # only the tokenizer changed
    assert v2["bytes_deduplicated"] == v2["bytes_total"] - v2["bytes_uploaded"]
    again = _publish(cp, models["v1"], "v1", publisher)
    assert (again["digest"], again["bytes_uploaded"]) == (v1["digest"], 0)

    _publish(cp, models["other"], "v1", publisher, model="mistral")
    assert {m["name"]: m["versions"] for m in cp.json("models", token=operator)} == {"llama": 2, "mistral": 1}

    listed = cp.json("versions", "llama", token=operator)
    assert {v["digest"] for v in listed} == {v1["digest"], v2["digest"]}
    shown = cp.json("show", "llama@v2", token=operator)
    assert shown["version"]["digest"] == v2["digest"]
    assert "tokenizer.json" in {f["path"] for f in shown["manifest"]["files"]}
    assert cp.json("show", f"llama@{v1['digest']}")["version"]["labels"] == ["v1"]

    assert cp.json("deploy", "create", "chat", "--model", "llama", token=operator)["epoch"] == 0
    cp.json("deploy", "set", "chat", "--stable", "v1", "--reason", "first", token=operator)
    moved = cp.json("deploy", "set", "chat", "--stable", "v2", token=operator)
    assert (moved["stable"], moved["previous_stable"], moved["epoch"]) == (v2["digest"], v1["digest"], 2)

    rolled = cp.json("rollback", "chat", "--reason", "p99 regression", token=operator)
    assert rolled["deployment"]["stable"] == v1["digest"]
    assert rolled["deployment"]["epoch"] == 3

    events = cp.json("history", "chat", token=operator)
    assert [(e["epoch"], e["action"]) for e in events] == [(3, "rollback"), (2, "set"), (1, "set")]
    assert events[0]["reason"] == "p99 regression"
    assert events[0]["actor"] == "oncall"

    human = cp.cli("history", "chat", token=operator)
    assert human.exit_code == 0
    assert "rollback" in human.stdout
    assert "p99 regression" in human.stdout


def test_publish_shows_progress_and_a_summary_to_people(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    result = controlplane.cli("publish", str(models["v1"]), "-m", "llama", "-l", "v1", "--chunk-size", CHUNK)
    assert result.exit_code == 0, result.stderr
    assert "published llama@v1" in result.stdout
    assert "deduplicated" in result.stdout
    assert "hashing" in result.stderr
    assert "uploading" in result.stderr


class _DropsPartsAfter(httpx.BaseTransport):
    """A real HTTP transport whose connection drops on every part upload after the first ``n``."""

    def __init__(self, n: int) -> None:
        self.inner = httpx.HTTPTransport()
        self.left = n
        self.sent: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            if self.left == 0:
                raise httpx.ConnectError("connection reset by peer", request=request)
            self.left -= 1
            self.sent.append(len(request.content))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_an_interrupted_publish_resumes_where_it_stopped(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    flaky = _DropsPartsAfter(3)
    with (
        Client(cp.url, ADMIN, transport=flaky) as client,
        pytest.raises(TemporaryError, match="run the same publish command again"),
    ):
        client.publish_directory(
            models["v1"], "llama", ["v1"], chunk_size=65536, concurrency=1, backoff=Backoff(attempts=1)
        )
    assert cp.json("models") == []  # nothing became a version

    resumed = _publish(cp, models["v1"], "v1", ADMIN)
    assert len(flaky.sent) == 3
    assert resumed["bytes_resumed"] == sum(flaky.sent)  # the three parts that got through were kept
    assert resumed["bytes_uploaded"] == resumed["bytes_total"] - resumed["bytes_resumed"]
    assert cp.json("show", "llama@v1")["version"]["digest"] == resumed["digest"]


def test_a_label_is_never_moved_to_other_content(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    publisher = controlplane.token("ci", "publisher")
    _publish(controlplane, models["v1"], "v1", publisher)
    result = controlplane.cli(
        "publish", str(models["v2"]), "-m", "llama", "-l", "v1", "--chunk-size", CHUNK, token=publisher
    )
    assert result.exit_code == 3, result.stderr
    assert "v1" in result.stderr
    assert [v["labels"] for v in controlplane.json("versions", "llama")] == [["v1"]]


def test_a_stale_expected_epoch_is_refused_and_explained(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    _publish(cp, models["v1"], "v1", ADMIN)
    _publish(cp, models["v2"], "v2", ADMIN)
    cp.json("deploy", "create", "chat", "--model", "llama")
    cp.json("deploy", "set", "chat", "--stable", "v1", "--expect-epoch", "0")
    stale = cp.cli("deploy", "set", "chat", "--stable", "v2", "--expect-epoch", "0")
    assert stale.exit_code == 3
    assert "no longer at epoch 0" in stale.stderr
    assert "weightship status chat" in stale.stderr
    assert cp.json("status", "chat")["deployment"]["epoch"] == 1


def test_rollback_without_a_previous_version_says_what_to_do(
    controlplane: ControlPlane, models: dict[str, Path]
) -> None:
    cp = controlplane
    _publish(cp, models["v1"], "v1", ADMIN)
    cp.json("deploy", "create", "chat", "--model", "llama")
    cp.json("deploy", "set", "chat", "--stable", "v1")
    result = cp.cli("rollback", "chat")
    assert result.exit_code == 3
    assert "no previous stable version" in result.stderr


def test_roles_are_enforced_with_a_clear_message(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    # an operator token (an agent enrolment token is refused everywhere but enrolment, also clearly)
    operator = cp.token("ops-1", "operator")
    denied = cp.cli("publish", str(models["v1"]), "-m", "llama", "--chunk-size", CHUNK, token=operator)
    assert denied.exit_code == 4
    assert "role 'operator'" in denied.stderr
    enrolment = cp.cli("models", token=cp.token("node-1", "agent"))
    assert enrolment.exit_code == 4
    assert "enrolment token" in enrolment.stderr
    unknown = cp.cli("models", token="ws_not_a_token")
    assert unknown.exit_code == 4
    assert "not valid" in unknown.stderr


def test_tokens_are_minted_listed_and_revoked(controlplane: ControlPlane) -> None:
    cp = controlplane
    created = cp.json("token", "create", "ci", "--role", "publisher")
    assert created["token"].startswith("ws_")
    assert "ci" in {t["name"] for t in cp.json("token", "list")}
    assert cp.json("models", token=created["token"]) == []
    assert cp.json("token", "revoke", created["id"]) == {"revoked": created["id"]}
    assert cp.cli("models", token=created["token"]).exit_code == 4
    assert "ci" not in {t["name"] for t in cp.json("token", "list")}


def test_nodes_and_status_show_what_the_fleet_reports(controlplane: ControlPlane, models: dict[str, Path]) -> None:
    cp = controlplane
    v1 = _publish(cp, models["v1"], "v1", ADMIN)
    cp.json("deploy", "create", "chat", "--model", "llama")
    cp.json("deploy", "set", "chat", "--stable", "v1")
    with Client(cp.url, cp.token("provisioning", "agent")) as enrolment:
        enrolled = enrolment.enrol_node(
            NodeEnrolRequest(name="gpu-a1", labels=NodeLabels(region="eu", gpu_type="h100"), deployments=["chat"])
        )
    with Client(cp.url, enrolled.token) as agent:
        node = enrolled.node
        size = v1["bytes_total"]
        agent.heartbeat(
            node.id,
            NodeHeartbeat(
                inventory=[
                    VersionInventory(
                        digest=v1["digest"], state=VersionState.ready, bytes_total=size, bytes_present=size
                    )
                ],
                deployments=[DeploymentState(name="chat", digest=v1["digest"], epoch=1)],
                counters=NodeCounters(bytes_downloaded=size),
            ),
        )
        desired = agent.desired_state(node.id)
    assert desired.deployments[0].digest == v1["digest"]

    (listed,) = cp.json("nodes")
    assert (listed["name"], listed["labels"]["gpu_type"], listed["stale"]) == ("gpu-a1", "h100", False)
    status = cp.json("status", "chat")
    stable = next(v for v in status["versions"] if v["role"] == "stable")
    assert (stable["nodes_desired"], stable["nodes_ready"], stable["nodes_serving"]) == (1, 1, 1)
    assert status["lagging_nodes"] == []

    people = cp.cli("nodes")
    assert people.exit_code == 0
    assert "gpu-a1" in people.stdout
    assert "eu/" in people.stdout
    shown = cp.cli("status", "chat")
    assert shown.exit_code == 0
    assert "every node serves what it should" in shown.stdout


@pytest.mark.parametrize("controlplane", ["local"], indirect=True)
def test_the_installed_console_script_talks_to_the_control_plane(controlplane: ControlPlane) -> None:
    script = Path(sys.executable).parent / "weightship"
    env = {"WEIGHTSHIP_URL": controlplane.url, "WEIGHTSHIP_TOKEN": ADMIN, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(script), "--json", "models"], env=env, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == []
    missing = subprocess.run([str(script), "history", "nope"], env=env, capture_output=True, timeout=60, check=False)
    assert missing.returncode == 1
    assert missing.stderr.decode().startswith("error: ")
    assert b"Traceback" not in missing.stderr


# --- publish checks what it can before hashing ----------------------------------------------------


def _publish_people(cp: ControlPlane, path: Path, *extra: str, token: str = ADMIN) -> Result:
    return cp.cli("publish", str(path), "-m", "llama", "--chunk-size", CHUNK, *extra, token=token)


def test_publish_to_a_wrong_url_fails_before_hashing(models: dict[str, Path]) -> None:
    env = {"WEIGHTSHIP_URL": f"http://127.0.0.1:{free_port()}", "WEIGHTSHIP_TOKEN": ADMIN}
    result = CliRunner().invoke(app, ["publish", str(models["v1"]), "-m", "llama"], env=env, catch_exceptions=False)
    assert result.exit_code == 5, result.stderr
    assert "WEIGHTSHIP_URL" in result.stderr
    assert "hashing" not in result.stderr


@pytest.mark.parametrize("controlplane", ["local"], indirect=True)
def test_publish_with_a_bad_token_or_role_fails_before_hashing(
    controlplane: ControlPlane, models: dict[str, Path]
) -> None:
    unknown = _publish_people(controlplane, models["v1"], token="ws_not_a_token")
    assert unknown.exit_code == 4
    assert "not valid" in unknown.stderr
    operator = _publish_people(controlplane, models["v1"], token=controlplane.token("ops-1", "operator"))
    assert operator.exit_code == 4
    assert "role 'operator'" in operator.stderr
    assert "--role publisher" in operator.stderr
    for result in (unknown, operator):
        assert "hashing" not in result.stderr


def _tokenizer(value: bytes) -> dict[str, bytes]:
    return {"tokenizer.json": value}


TAKEN_LABEL_CASES = [
    pytest.param({"chunk": "128KiB"}, "chunk size", id="other-chunk-size"),
    pytest.param({"extra_files": {"notes.txt": b"x"}}, "files only here", id="extra-file"),
    pytest.param({"extra_files": _tokenizer(b'{"v": 1, "longer": 1}')}, "bytes here", id="other-size"),
    pytest.param({"extra_files": _tokenizer(b'{"v": 9}')}, "tokenizer.json holds other bytes", id="same-size-small"),
    pytest.param({"seed": 2, "extra_files": _tokenizer(b'{"v": 1}')}, "holds other bytes", id="other-weights"),
]


@pytest.mark.parametrize("controlplane", ["local"], indirect=True)
@pytest.mark.parametrize(("change", "reason"), TAKEN_LABEL_CASES)
def test_a_label_taken_by_other_content_is_refused_before_hashing(
    controlplane: ControlPlane, make_model: Any, change: dict[str, Any], reason: str
) -> None:
    original = make_model("a", tensors_mb=0.5, seed=1, shards=2, extra_files=_tokenizer(b'{"v": 1}'))
    _publish(controlplane, original, "v1", ADMIN)
    other = make_model(
        "b",
        tensors_mb=0.5,
        seed=change.get("seed", 1),
        shards=2,
        extra_files={**_tokenizer(b'{"v": 1}'), **change.get("extra_files", {})},
    )
    result = controlplane.cli(
        "publish", str(other), "-m", "llama", "-l", "v1", "--chunk-size", change.get("chunk", CHUNK)
    )
    assert result.exit_code == 3, result.stderr
    assert "label 'v1'" in result.stderr
    assert reason in result.stderr
    assert "hashing" not in result.stderr


@pytest.mark.parametrize("controlplane", ["local"], indirect=True)
def test_hidden_files_are_listed_as_skipped(controlplane: ControlPlane, make_model: Any) -> None:
    root = make_model("m", tensors_mb=0.1, extra_files={".gitattributes": b"*.safetensors filter=lfs\n"})
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    scripted = controlplane.json("publish", str(root), "-m", "llama", "--chunk-size", CHUNK)
    assert scripted["skipped"] == [".git", ".gitattributes"]
    assert ".gitattributes" not in {
        f["path"] for f in controlplane.json("show", f"llama@{scripted['digest']}")["manifest"]["files"]
    }
    people = _publish_people(controlplane, root)
    assert people.exit_code == 0, people.stderr
    assert "skipped 2 hidden names" in people.stdout
    assert ".git, .gitattributes" in people.stdout


@pytest.mark.parametrize("controlplane", ["local"], indirect=True)
def test_the_progress_bar_ends_on_the_hashing_speed_the_summary_shows(
    controlplane: ControlPlane, models: dict[str, Path]
) -> None:
    result = _publish_people(controlplane, models["v1"])
    assert result.exit_code == 0, result.stderr
    summary = re.search(r"hashed\s+\S+s\s+(\S+ \S+/s)", result.stdout)
    assert summary is not None, result.stdout
    bars = [line for line in result.stderr.splitlines() if line.startswith("hashing")]
    assert bars, result.stderr
    assert summary.group(1) in bars[-1]
