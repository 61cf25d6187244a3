"""The start commands in docs/model-servers.md, run with stand-in ``vllm`` and ``text-generation-launcher`` programs.

Each recipe's shell is run as written (only ``/var/lib/weightship`` moves to a test directory), with
programs of those names on ``PATH`` that record their arguments: the server is started on the
resolved version directory, never on the link, with the flags the doc promises.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

from tests.agent.agent_processes import REPO

DOC = REPO / "docs" / "model-servers.md"
HEX = "c0ffee" * 10 + "beef"


def block(language: str, containing: str) -> str:
    """The doc's ``language`` block that contains ``containing``."""
    blocks: list[str] = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    (found,) = [b for b in blocks if containing in b]
    return found


def node(tmp_path: Path) -> Path:
    """A data directory as the agent lays it out, deployment ``chat`` linked to one version."""
    data = tmp_path / "weightship"
    (data / "versions" / HEX).mkdir(parents=True)
    (data / "deployments" / "chat").mkdir(parents=True)
    (data / "deployments" / "chat" / "current").symlink_to(f"../../versions/{HEX}")
    return data


def run(tmp_path: Path, argv: list[str], env: dict[str, str], program: str) -> list[str]:
    """Run ``argv`` with a stand-in ``program`` on PATH; the arguments it was started with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / program
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/args"\n')
    fake.chmod(0o755)
    subprocess.run(argv, env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, check=True, timeout=30)
    return (tmp_path / "args").read_text().splitlines()


def test_the_vllm_start_script_serves_the_resolved_version_named_by_its_digest(tmp_path: Path) -> None:
    data = node(tmp_path)
    script = tmp_path / "vllm-chat"
    script.write_text(block("sh", "/usr/local/bin/vllm-chat").replace("/var/lib/weightship", str(data)))
    args = run(tmp_path, ["/bin/sh", str(script)], {}, "vllm")
    assert args == [
        "serve", str(data.resolve() / "versions" / HEX), "--served-model-name", f"sha256:{HEX}", "chat",
        "--load-format", "safetensors", "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip


def test_the_tgi_start_script_serves_the_resolved_version(tmp_path: Path) -> None:
    data = node(tmp_path)
    script = tmp_path / "tgi-chat"
    script.write_text(block("sh", "/usr/local/bin/tgi-chat").replace("/var/lib/weightship", str(data)))
    args = run(tmp_path, ["/bin/sh", str(script)], {}, "text-generation-launcher")
    assert args == ["--model-id", str(data.resolve() / "versions" / HEX), "--hostname", "0.0.0.0", "--port", "8080"]


def test_the_pinned_pod_serves_its_digests_version_directory(tmp_path: Path) -> None:
    data = node(tmp_path)
    template = yaml.safe_load(block("yaml", "vllm/vllm-openai"))["template"]
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    (line,) = container["args"]
    env = {"WEIGHTSHIP_DIGEST": f"sha256:{HEX}", "WEIGHTSHIP_DEPLOYMENT": "chat", "WEIGHTSHIP_VERSIONS_DIR": f"{data}/versions"}  # what the operator sets
    args = run(tmp_path, ["/bin/sh", "-c", line.replace("/var/lib/weightship", str(data))], env, "vllm")
    assert args == [
        "serve", f"{data}/versions/{HEX}", "--served-model-name", f"sha256:{HEX}", "chat",
        "--load-format", "safetensors", "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip
