"""Switch hooks are configured per deployment: flags, the config file and the environment; bad ones are refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from agent.config import load_config
from agent.hookcalls import DEFAULT_TIMEOUT, SwitchHook
from weightship.errors import ValidationError

BASE = ["--control-plane", "http://cp:8080", "--deployment", "chat", "--deployment", "embed"]


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (
            "chat=command:systemctl restart 'vllm chat'",
            SwitchHook("chat", "command", argv=("systemctl", "restart", "vllm chat")),
        ),
        ("chat=signal:/run/vllm.pid", SwitchHook("chat", "signal", signal=signal.SIGHUP, pidfile="/run/vllm.pid")),
        ("chat=signal:USR1:/run/vllm.pid", SwitchHook("chat", "signal", signal=signal.SIGUSR1, pidfile="/run/vllm.pid")),
        ("chat=http://127.0.0.1:8000/reload", SwitchHook("chat", "http", url="http://127.0.0.1:8000/reload")),
    ],
)
def test_a_switch_hook_flag_names_its_deployment_and_kind(flag: str, expected: SwitchHook) -> None:
    config = load_config([*BASE, "--switch-hook", flag], {})
    assert config.switch_hooks == (expected,)


def test_hooks_come_from_config_file_tables_and_the_timeout_flag_fills_the_unset_ones(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(
        'control_plane = "http://cp:8080"\ndeployments = ["chat", "embed"]\n'
        '[switch_hooks.chat]\ncommand = ["systemctl", "restart", "vllm-chat"]\ntimeout = 300\n'
        '[switch_hooks.embed]\nhttp = "http://127.0.0.1:8080/reload"\n'
    )
    config = load_config(["--config", str(path), "--switch-hook-timeout", "20"], {})
    hooks = {h.deployment: h for h in config.switch_hooks}
    assert hooks["chat"] == SwitchHook("chat", "command", argv=("systemctl", "restart", "vllm-chat"), timeout=300)
    assert hooks["embed"] == SwitchHook("embed", "http", url="http://127.0.0.1:8080/reload", timeout=20)


def test_hooks_come_from_the_environment_one_per_line() -> None:
    env = {"WEIGHTSHIP_AGENT_SWITCH_HOOKS": "chat=signal:HUP:/run/a.pid\nembed=http://127.0.0.1:1/r\n"}
    config = load_config(BASE, env)
    assert [(h.deployment, h.kind, h.timeout) for h in config.switch_hooks] == [
        ("chat", "signal", DEFAULT_TIMEOUT),
        ("embed", "http", DEFAULT_TIMEOUT),
    ]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("chat", "must be DEPLOYMENT=command:PROGRAM ARGS"),
        ("chat=command:", "command is empty"),
        ("chat=signal:BOGUS:/run/x.pid", "unknown signal 'BOGUS'"),
        ("chat=ftp://host/reload", "is not command:..., signal:... or an http(s) URL"),
        ("other=http://127.0.0.1:1/r", "which this node does not serve; add --deployment other"),
    ],
)
def test_a_bad_switch_hook_is_refused_with_what_to_write(flag: str, message: str) -> None:
    with pytest.raises(ValidationError, match="switch hook") as caught:
        load_config([*BASE, "--switch-hook", flag], {})
    assert message in caught.value.message


def test_a_deployment_gets_one_hook() -> None:
    with pytest.raises(ValidationError, match="one hook per deployment"):
        load_config([*BASE, "--switch-hook", "chat=signal:/a.pid", "--switch-hook", "chat=signal:/b.pid"], {})


DOC = Path(__file__).resolve().parents[2] / "docs" / "model-servers.md"


def test_every_hook_setting_in_the_model_servers_doc_loads(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    flags = re.findall(r"`(chat=[^`]+)`", text)
    assert len(flags) >= 3
    for flag in flags:
        (hook,) = load_config([*BASE, "--switch-hook", flag], {}).switch_hooks
        assert hook.deployment == "chat"
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 2
    kinds = []
    for i, block in enumerate(blocks):
        path = tmp_path / f"agent-{i}.toml"
        path.write_text(block)
        config = load_config(["--config", str(path), *BASE], {})
        kinds += [(h.kind, h.argv[0], h.timeout) for h in config.switch_hooks]
    assert kinds == [("command", "systemctl", 600.0), ("command", "/bin/sh", 600.0)]


def test_the_docs_tgi_hook_writes_a_file_sd_entry_naming_the_digest(tmp_path: Path) -> None:
    """The TGI recipe's command, run with `systemctl` made a no-op and the targets directory moved here."""
    block = next(b for b in re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL) if "tgi" in b)
    path = tmp_path / "agent.toml"
    path.write_text(block.replace("/etc/prometheus/targets", str(tmp_path)))
    (hook,) = load_config(["--config", str(path), *BASE], {}).switch_hooks
    argv = [a.replace("systemctl restart tgi-chat", "true") for a in hook.argv]
    digest = "sha256:" + "ab" * 32
    env = {"PATH": os.environ["PATH"], "WEIGHTSHIP_DIGEST": digest, "WEIGHTSHIP_DEPLOYMENT": "chat"}
    subprocess.run(argv, env=env, check=True, timeout=30)
    (entry,) = json.loads((tmp_path / "tgi-chat.json").read_text())
    assert entry["labels"] == {"digest": digest, "deployment": "chat"}
    assert entry["targets"][0].endswith(":8080")
