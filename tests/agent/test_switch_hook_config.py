"""Switch hooks are configured per deployment: flags, the config file and the environment; bad ones are refused."""

from __future__ import annotations

import signal
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
