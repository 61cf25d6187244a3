"""``weightship rollout ... --kube`` on ModelRollouts: the real CLI process, the real ``kubernetes`` client, kmock.

The CLI runs as its own process with a kubeconfig whose context points at kmock (as a user's
kubeconfig points at EKS), while a real kopf operator drives the rollout in the test's loop. What
the CLI prints is read back as a user or script would: ``--json`` for the schema, exit statuses,
the one-line errors on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubernetes.conftest import NAMESPACE, Operators, VersionedEmulator
from tests.kubernetes.rollout_parts import apply, deployed, rollout, status, stored
from weightship.testing import eventually_async

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("replicaset_controller")]

ROOT = Path(__file__).parents[2]
WAIT = 30.0
@dataclass
class Cli:
    """Runs ``weightship`` as a separate process with a kubeconfig naming kmock."""

    kubeconfig: Path

    async def __call__(self, *args: str, seconds: float = 60.0) -> tuple[int, str, str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
        env.pop("WEIGHTSHIP_URL", None)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from weightship.cli import main; main()", *args,
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), seconds)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    async def json(self, *args: str) -> Any:
        code, out, err = await self("--json", "rollout", *args)
        assert code == 0, f"weightship rollout {' '.join(args)} exited {code}: {err}"
        return json.loads(out)


@pytest.fixture
def cli(kmock_server: VersionedEmulator, tmp_path: Path) -> Cli:
    """The CLI with a kubeconfig: context ``kmock`` (namespace models, current) and ``elsewhere`` (no server)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "kmock", "cluster": {"server": str(kmock_server.url).rstrip("/")}},
            {"name": "gone", "cluster": {"server": "http://127.0.0.1:9"}},
        ],
        "users": [{"name": "dev", "user": {"token": "kmock-accepts-anything"}}],
        "contexts": [
            {"name": "kmock", "context": {"cluster": "kmock", "user": "dev", "namespace": NAMESPACE}},
            {"name": "elsewhere", "context": {"cluster": "gone", "user": "dev"}},
        ],
        "current-context": "elsewhere",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return Cli(path)


async def paused_canary(server: VersionedEmulator, operators: Operators, digests: dict[str, str]) -> None:
    """v1 deployed, then v2 at 25% and paused until promoted."""
    operators.start("op-a")
    await apply(server, rollout("v1", []))
    await deployed(server, digests["v1"])
    await apply(server, rollout("v2", [{"setWeight": 25}, {"pause": {}}]))
    await eventually_async(lambda: status(server).get("phase") == "Paused", WAIT, "the indefinite pause")
    await eventually_async(lambda: status(server).get("weight") == 25, WAIT, "the canary at 25%")


async def test_kube_status_shows_the_modelrollout_as_a_rollout_with_pods_per_version(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cli: Cli
) -> None:
    _, digests = controlplane
    await paused_canary(kmock_server, operators, digests)

    shown = await cli.json("status", "chat", "--kube", "--context", "kmock")
    assert shown["id"] == f"{NAMESPACE}/chat"
    assert (shown["deployment"], shown["version"], shown["stable"]) == ("chat-prod", digests["v2"], digests["v1"])
    assert (shown["phase"], shown["weight"], shown["step_index"], shown["steps_total"]) == ("Paused", 25.0, 1, 2)
    assert [(s["kind"], s["state"]) for s in shown["steps"]] == [("setWeight", "done"), ("pause", "current")]
    assert shown["nodes"] == {digests["v1"]: 3, digests["v2"]: 1}  # ready pods per version
    assert shown["target_nodes"] == 4

    code, out, err = await cli("rollout", "status", "chat", "--context", "kmock")  # --context implies --kube
    assert code == 0, err
    for expected in ("Paused", "25% canary", "pause until promoted", "▶ current", "PODS", digests["v1"]):
        assert expected in out, f"{expected!r} missing from:\n{out}"


async def test_kube_list_and_a_missing_modelrollout(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cli: Cli
) -> None:
    _, digests = controlplane
    operators.start("op-a")
    await apply(kmock_server, rollout("v1", []))
    await deployed(kmock_server, digests["v1"])

    listed = await cli.json("list", "--context", "kmock")
    assert [(r["id"], r["phase"], r["completed"]) for r in listed] == [(f"{NAMESPACE}/chat", "Healthy", True)]

    code, _, err = await cli("rollout", "status", "nope", "--context", "kmock")
    assert code == 1
    assert f"ModelRollout {NAMESPACE}/nope" in err
    assert "not found" in err
    assert f"weightship rollout list --kube --namespace {NAMESPACE}" in err


async def test_kube_an_unreachable_cluster_and_an_unknown_context_are_one_line_each(cli: Cli) -> None:
    code, _, err = await cli("rollout", "status", "chat", "--kube")  # current context: a closed port
    assert code == 5
    assert "is unreachable" in err
    assert "--context" in err
    assert err.count("\n") == 1

    code, _, err = await cli("rollout", "status", "chat", "--context", "nope")
    assert code == 1
    assert "no context 'nope'" in err
    assert "elsewhere, kmock" in err


async def test_kube_a_verb_no_operator_answers_times_out_and_stays_requested(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cli: Cli
) -> None:
    _, digests = controlplane
    await paused_canary(kmock_server, operators, digests)
    await operators.stop("op-a")

    code, _, err = await cli("rollout", "promote", "chat", "--context", "kmock", "--wait", "1")
    assert code == 5
    assert "no operator acted on promote within 1 s" in err
    assert stored(kmock_server, "chat")["metadata"]["annotations"]["weightship.io/verb"].startswith("promote@")


async def test_kube_a_verb_on_a_refused_modelrollout_is_refused_with_the_operators_reason(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cli: Cli
) -> None:
    operators.start("op-a")
    await apply(kmock_server, rollout("v99", [{"setWeight": 10}]))
    await eventually_async(lambda: status(kmock_server).get("phase") == "Invalid", WAIT, "the refusal")

    code, _, err = await cli("rollout", "promote", "chat", "--context", "kmock", "--wait", "10")
    assert code == 3
    assert "refused by the operator" in err
    assert "'v99'" in err

    code, out, _ = await cli("--json", "rollout", "status", "chat", "--context", "kmock", "--watch", "--timeout", "10")
    assert code == 1  # --watch ends on a rollout that cannot progress
    assert json.loads(out.splitlines()[-1])["phase"] == "Invalid"


async def test_kube_promote_then_watch_until_healthy(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cli: Cli
) -> None:
    _, digests = controlplane
    await paused_canary(kmock_server, operators, digests)

    promoted = await cli.json("promote", "chat", "--context", "kmock", "--wait", "20")
    assert promoted["phase"] in ("Progressing", "Healthy")
    code, out, err = await cli(
        "--json", "rollout", "status", "chat", "--context", "kmock", "--watch", "--interval", "0.2", "--timeout", "30"
    )
    assert code == 0, err
    last = json.loads(out.splitlines()[-1])
    assert (last["phase"], last["completed"], last["version"]) == ("Healthy", True, digests["v2"])
    assert last["stable"] == digests["v1"]  # as for a fleet rollout: the rollback target it captured


async def test_kube_abort_then_retry_and_a_verb_that_does_not_fit(
    kmock_server: VersionedEmulator, operators: Operators, controlplane: tuple[str, dict[str, str]], cli: Cli
) -> None:
    _, digests = controlplane
    await paused_canary(kmock_server, operators, digests)

    code, _, err = await cli("rollout", "retry", "chat", "--context", "kmock", "--wait", "20")
    assert code == 3  # nothing to retry: the operator's reason names what fits
    assert "refused retry" in err

    aborted = await cli.json("abort", "chat", "--context", "kmock", "--wait", "20")
    assert (aborted["phase"], aborted["aborted"]) == ("Degraded", True)
    retried = await cli.json("retry", "chat", "--context", "kmock", "--wait", "20")
    assert retried["phase"] != "Degraded"
    assert retried["attempt"] == 2
