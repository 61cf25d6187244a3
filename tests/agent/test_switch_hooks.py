"""An agent drives an external model server: after each switch its hook tells the server, which then serves the new version.

Real processes: the control plane, an agent, and the stand-in server (``tests.agent.external_server``)
reading its weights from the deployment's ``current`` link, as vLLM or TGI would.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from tests.agent.agent_processes import Spawn, eventually
from tests.agent.external_server import ExternalServerProcess, load
from tests.agent.fleet import Fleet
from weightship.cli.display import nodes_table, status_view
from weightship.digests import hex_of
from weightship.layout import read_verification
from weightship.manifest import Manifest
from weightship.schemas import SwitchHookResult

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def answers(tmp_path: Path) -> dict[str, str]:
    """What the stand-in answers for each version of the ``versions`` fixture (from the published files)."""
    return {label: load(tmp_path / f"model-{label}").answer for label in ("v1", "v2", "v3")}


def current_link(tmp_path: Path, node: str, deployment: str) -> Path:
    """The stable path a server reads: ``<data_dir>/deployments/<deployment>/current`` of ``spawn``'s agent ``node``."""
    return tmp_path / "agents" / node / "deployments" / deployment / "current"


async def test_an_http_hook_reloads_the_server_after_a_promotion_and_a_rollback(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str, tmp_path: Path
) -> None:
    expected = answers(tmp_path)
    v1, v2 = versions["v1"].digest, versions["v2"].digest
    server = ExternalServerProcess(tmp_path / "server", current_link(tmp_path, "node-a", deployment)).start()
    try:
        fleet.point(deployment, model, "v1")
        agent = spawn("node-a", extra=["--switch-hook", f"{deployment}=http://127.0.0.1:{server.port}/reload"])
        await agent.ready()
        await eventually(lambda: server.answer() == expected["v1"], 60, "the server to answer with v1")

        fleet.point(deployment, model, "v2")
        await eventually(lambda: server.answer() == expected["v2"], 60, "the server to answer with v2")
        fleet.rollback(deployment)
        await eventually(lambda: server.answer() == expected["v1"], 60, "the server to answer with v1 again")

        calls = server.reloads()
        assert [c["digest"] for c in calls] == [v1, v2, v1]
        assert [c["previous_digest"] for c in calls] == ["", v1, v2]
        assert [c["epoch"] for c in calls] == [1, 2, 3]
        assert calls[1]["path"] == str(agent.data_dir.resolve() / "versions" / hex_of(v2))
        assert {c["deployment"] for c in calls} == {deployment}

        async def reported() -> SwitchHookResult | None:
            node = fleet.node("node-a")
            hook = node.serving[0].hook if node and node.serving else None
            return hook if hook is not None and hook.epoch == 3 else None

        hook = await eventually(reported, 15, "the heartbeat to report the rollback's hook call")
        assert (hook.kind, hook.digest, hook.ok, hook.http_status, hook.attempts) == ("http", v1, True, 200, 0)
        state = json.loads((agent.data_dir / "state" / "switch-hooks.json").read_text())
        assert state["announced"] == {deployment: v1}
    finally:
        server.stop()


async def test_a_signal_hook_makes_the_server_reload_from_the_link(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str, tmp_path: Path
) -> None:
    expected = answers(tmp_path)
    server = ExternalServerProcess(tmp_path / "server", current_link(tmp_path, "node-s", deployment)).start()
    try:
        fleet.point(deployment, model, "v1")
        agent = spawn("node-s", extra=["--switch-hook", f"{deployment}=signal:SIGHUP:{server.pidfile}"])
        await agent.ready()
        await eventually(lambda: server.answer() == expected["v1"], 60, "the server to answer with v1")
        fleet.point(deployment, model, "v3")
        await eventually(lambda: server.answer() == expected["v3"], 60, "the server to answer with v3")

        async def reported() -> SwitchHookResult | None:
            hook = (await agent.status()).deployments[0].hook
            return hook if hook is not None and hook.digest == versions["v3"].digest else None

        hook = await eventually(reported, 15, "the signal hook's call for v3 to be reported")
        assert (hook.kind, hook.ok, hook.exit_code, hook.http_status) == ("signal", True, None, None)
    finally:
        server.stop()


async def test_a_failing_hook_is_reported_retried_and_leaves_the_link_on_the_verified_version(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str, tmp_path: Path
) -> None:
    expected = answers(tmp_path)
    v1 = versions["v1"].digest
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    script = hooks / "reload.sh"
    server = ExternalServerProcess(tmp_path / "server", current_link(tmp_path, "node-f", deployment)).start()
    script.write_text(
        "#!/bin/sh\n"
        f'env | grep "^WEIGHTSHIP_" | sort > "{hooks}/env-$WEIGHTSHIP_EPOCH"\n'
        f'test -e "{hooks}/allow" || {{ echo "vllm is draining; reload refused" >&2; exit 3; }}\n'
        f'kill -HUP "$(cat "{server.pidfile}")"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    try:
        fleet.point(deployment, model, "v1")
        agent = spawn(
            "node-f",
            extra=["--switch-hook", f"{deployment}=command:{script}", "--peer-listen", "127.0.0.1:0"],
        )
        await agent.ready()

        async def failed_twice() -> SwitchHookResult | None:
            hook = (await agent.status()).deployments[0].hook if (await agent.status()).deployments else None
            return hook if hook is not None and not hook.ok and hook.attempts >= 2 else None

        hook = await eventually(failed_twice, 60, "the hook to fail and be retried")
        assert hook.kind == "command"
        assert hook.exit_code == 3
        assert hook.detail == "exit 3: vllm is draining; reload refused"
        assert hook.retry_at is not None
        assert server.answer() is None  # it never loaded: nothing told it to

        # The link points at v1, verified on this node, all along.
        link = current_link(tmp_path, "node-f", deployment)
        assert os.readlink(link) == f"../../versions/{hex_of(v1)}"
        record = read_verification(link.resolve())
        assert record is not None
        assert record.digest == v1

        env = (hooks / "env-1").read_text().splitlines()
        assert f"WEIGHTSHIP_DEPLOYMENT={deployment}" in env
        assert f"WEIGHTSHIP_DIGEST={v1}" in env
        assert f"WEIGHTSHIP_PATH={link.resolve()}" in env
        assert "WEIGHTSHIP_PREVIOUS_DIGEST=" in env
        assert "WEIGHTSHIP_EPOCH=1" in env

        # The control plane shows it: `weightship nodes` lists it among the node's problems.
        def problem_shown() -> str | None:
            node = fleet.node("node-f")
            if node is None or not any("switch hook" in e for e in node.health.errors):
                return None
            console = Console(record=True, width=400)
            console.print(nodes_table([node]))
            return console.export_text()

        table = await eventually(problem_shown, 15, "the failing hook in the node's report")
        assert f"switch hook of deployment {deployment}" in table
        assert "exit 3: vllm is draining; reload refused" in table
        # ... and `weightship status DEPLOYMENT` names the node and why.
        with fleet.cp.client() as admin:
            status = admin.deployment_status(deployment)
        assert len(status.hook_failures) == 1
        assert status.hook_failures[0].startswith(f"node-f: command hook failed for {v1} (")
        assert status.hook_failures[0].endswith("): exit 3: vllm is draining; reload refused")
        console = Console(record=True, width=400)
        console.print(status_view(status))
        assert "switch hooks that keep failing" in console.export_text()
        metrics = await peer_metrics(agent.data_dir)
        assert f'weightship_agent_switch_hook_failing{{deployment="{deployment}"}} 1' in metrics

        (hooks / "allow").touch()
        await eventually(lambda: server.answer() == expected["v1"], 60, "the retried hook to make the server load v1")

        async def ok() -> SwitchHookResult | None:
            hook = (await agent.status()).deployments[0].hook
            return hook if hook is not None and hook.ok else None

        await eventually(ok, 15, "the hook to be reported ok")
        assert not [e for e in (await agent.status()).health.errors if "switch hook" in e]
        metrics = await peer_metrics(agent.data_dir)
        assert f'weightship_agent_switch_hook_failing{{deployment="{deployment}"}} 0' in metrics
        assert f'weightship_agent_announced_version_info{{deployment="{deployment}",digest="{v1}"}} 1' in metrics
    finally:
        server.stop()


async def peer_metrics(data_dir: Path) -> str:
    """The agent's ``/metrics`` (on its peer listener)."""
    peer = json.loads((data_dir / "agent.json").read_text())["peer"]
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{peer}/metrics")
    response.raise_for_status()
    return response.text


def reload_script(hooks: Path, server: ExternalServerProcess, refused_digest: str = "") -> Path:
    """A command hook that logs each call, refuses ``refused_digest`` (or all until ``allow`` exists), else sends SIGHUP."""
    script = hooks / "reload.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$WEIGHTSHIP_DIGEST" >> "{hooks}/calls"\n'
        f'test -e "{hooks}/allow" || {{ echo "not allowed yet" >&2; exit 4; }}\n'
        f'test "$WEIGHTSHIP_DIGEST" != "{refused_digest}" || {{ echo "this server cannot run $WEIGHTSHIP_DIGEST" >&2; exit 5; }}\n'
        f'kill -HUP "$(cat "{server.pidfile}")"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


async def test_a_newer_switch_is_announced_without_waiting_out_the_backoff_and_a_switch_back_ends_the_retries(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str, tmp_path: Path
) -> None:
    expected = answers(tmp_path)
    v2, v3 = versions["v2"].digest, versions["v3"].digest
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "allow").touch()
    server = ExternalServerProcess(tmp_path / "server", current_link(tmp_path, "node-n", deployment)).start()
    script = reload_script(hooks, server, refused_digest=v2)
    try:
        fleet.point(deployment, model, "v1")
        agent = spawn("node-n", extra=["--switch-hook", f"{deployment}=command:{script}"])
        await agent.ready()
        await eventually(lambda: server.answer() == expected["v1"], 60, "the server to answer with v1")

        fleet.point(deployment, model, "v2")

        async def backing_off() -> SwitchHookResult | None:  # 6 failures: the next retry is seconds away
            hook = (await agent.status()).deployments[0].hook
            return hook if hook is not None and hook.digest == v2 and hook.attempts >= 6 else None

        failing = await eventually(backing_off, 60, "the hook for v2 to keep failing")
        assert failing.detail == f"exit 5: this server cannot run {v2}"
        assert failing.retry_at is not None

        fleet.point(deployment, model, "v3")
        await eventually(lambda: server.answer() == expected["v3"], 60, "the server to answer with v3")

        async def announced_v3() -> SwitchHookResult | None:
            hook = (await agent.status()).deployments[0].hook
            return hook if hook is not None and hook.digest == v3 and hook.ok else None

        announced = await eventually(announced_v3, 15, "the hook's call for v3 to be reported")
        assert announced.at < failing.retry_at, "v3 was announced only when v2's backoff ran out"

        fleet.point(deployment, model, "v2")  # refused again, then the operator rolls back to v3

        async def failing_again() -> bool:
            hook = (await agent.status()).deployments[0].hook
            return hook is not None and hook.digest == v2 and not hook.ok

        await eventually(failing_again, 60, "the hook for v2 to fail again")
        fleet.rollback(deployment)

        async def moot() -> SwitchHookResult | None:
            status = await agent.status()
            hook = status.deployments[0].hook
            quiet = not [e for e in status.health.errors if "switch hook" in e]
            return hook if hook is not None and hook.digest == v3 and hook.ok and quiet else None

        await eventually(moot, 60, "the rollback to v3 to end the retries for v2")
        assert server.answer() == expected["v3"]
    finally:
        server.stop()


async def test_a_switch_whose_hook_had_not_succeeded_is_announced_after_the_agent_restarts(
    spawn: Spawn, fleet: Fleet, versions: dict[str, Manifest], model: str, deployment: str, tmp_path: Path
) -> None:
    expected = answers(tmp_path)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    server = ExternalServerProcess(tmp_path / "server", current_link(tmp_path, "node-r", deployment)).start()
    script = reload_script(hooks, server)
    try:
        fleet.point(deployment, model, "v1")
        agent = spawn("node-r", extra=["--switch-hook", f"{deployment}=command:{script}"])
        await agent.ready()

        async def failed() -> bool:
            hook = (await agent.status()).deployments[0].hook
            return hook is not None and not hook.ok

        await eventually(failed, 60, "the hook to fail")
        agent.stop()
        (hooks / "allow").touch()
        agent.start()
        await agent.ready()
        await eventually(lambda: server.answer() == expected["v1"], 60, "the restarted agent to announce v1")
        state = json.loads((agent.data_dir / "state" / "switch-hooks.json").read_text())
        assert state["announced"] == {deployment: versions["v1"].digest}
    finally:
        server.stop()
