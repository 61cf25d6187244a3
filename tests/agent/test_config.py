"""Agent configuration: file < environment < flags; sizes; tokens from files; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.config import load_config
from weightship.errors import ValidationError


def test_flags_override_environment_which_overrides_the_file(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.toml"
    config_file.write_text(
        'control_plane = "http://file:8080"\nname = "from-file"\nquota = "1GiB"\ndeployments = ["a", "b"]\n'
        '[labels]\nregion = "eu"\nrack = "r1"\n'
    )
    env = {"WEIGHTSHIP_AGENT_NAME": "from-env", "WEIGHTSHIP_AGENT_ZONE": "z2", "WEIGHTSHIP_AGENT_TOKEN": "t-env"}
    config = load_config(["--config", str(config_file), "--rack", "r9", "--concurrency", "3"], env)
    assert config.control_plane == "http://file:8080"
    assert config.name == "from-env"
    assert config.quota_bytes == 1024**3
    assert config.deployments == ("a", "b")
    assert (config.labels.region, config.labels.zone, config.labels.rack) == ("eu", "z2", "r9")
    assert config.token == "t-env"
    assert config.concurrency == 3


def test_json_file_and_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("ws_secret\n")
    (tmp_path / "agent.json").write_text(
        json.dumps({"control_plane": "http://cp", "token_file": str(tmp_path / "token"), "gpu_type": "h200"})
    )
    config = load_config(
        [], {"WEIGHTSHIP_AGENT_CONFIG": str(tmp_path / "agent.json"), "WEIGHTSHIP_AGENT_DEPLOYMENTS": "x, y"}
    )
    assert config.token == "ws_secret"
    assert config.labels.gpu_type == "h200"
    assert config.deployments == ("x", "y")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no control plane configured"),
        (["--control-plane", "ftp://x"], "must be an http"),
        (["--control-plane", "http://x", "--quota", "lots"], "is not a number of bytes"),
        (["--control-plane", "http://x", "--name", "Bad Name"], "invalid model name"),
        (["--control-plane", "http://x", "--concurrency", "0"], "at least 1"),
    ],
)
def test_bad_settings_fail_with_a_message_naming_the_setting(argv: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        load_config(argv, {})


def test_unknown_file_setting_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"control_plane": "http://x", "qouta": 5}))
    with pytest.raises(ValidationError, match="unknown setting 'qouta'"):
        load_config(["--config", str(tmp_path / "a.json")], {})


def test_url_and_comma_separated_deployments_are_accepted_too() -> None:
    config = load_config(["--url", "http://cp:8080", "--deployments", "chat,embed", "--deployment", "x"], {})
    assert config.control_plane == "http://cp:8080"
    assert config.deployments == ("x", "chat", "embed")


def test_the_clis_variables_are_a_fallback() -> None:
    env = {"WEIGHTSHIP_URL": "http://cli:8080", "WEIGHTSHIP_TOKEN": "t-cli"}
    config = load_config([], env)
    assert (config.control_plane, config.token) == ("http://cli:8080", "t-cli")
    config = load_config([], {**env, "WEIGHTSHIP_AGENT_TOKEN": "t-agent"})
    assert config.token == "t-agent"
