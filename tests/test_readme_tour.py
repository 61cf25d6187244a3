"""README's five-minute tour, run as written: its shell block, line by line, against a real control plane.

The block is taken from README.md at run time, so the tour cannot drift from the code. What the
test changes, and only that: the virtualenv is this checkout's (not ``make venv``), the port is a
free one instead of 8080 (``WEIGHTSHIP_URL`` says so to the CLI), ``/tmp/`` is a temporary
directory, and the rollout's ``pause=30s`` is ``pause=1s``. Each background process is waited for
(the control plane answering ``/readyz``) and stopped at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from weightship.testing import free_port

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def tour_block() -> list[str]:
    """The lines of the ``sh`` block under README.md's "A five-minute tour" heading."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## A five-minute tour", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, "README.md's tour has no ```sh block"
    return [line for line in block[1].splitlines() if line.strip() and not line.lstrip().startswith("#")]


def tour_script(lines: list[str], port: int, work: Path) -> str:
    """The tour as one bash script, with the test's substitutions and waits."""
    assert lines[0] == "make venv && source .venv/bin/activate", lines[0]
    script = [
        "set -euo pipefail",
        "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT",
        f"source {REPO}/.venv/bin/activate",
        f"export WEIGHTSHIP_URL=http://127.0.0.1:{port}",
        f"cd {work}",
    ]
    for line in lines[1:]:
        line = line.replace("8080", str(port)).replace("/tmp/", f"{work}/").replace("pause=30s", "pause=1s")
        script.append(f"echo {shlex.quote('+ ' + line)}")
        script.append(line)
        if line.split("#")[0].rstrip().endswith("&") and "weightship-controlplane serve" in line:
            script.append(
                "for _ in $(seq 300); do curl -sf $WEIGHTSHIP_URL/readyz >/dev/null && break; sleep 0.1; done"
            )  # ok-sleep: polling interval of a bounded readiness loop in the shell
    return "\n".join(script) + "\n"


def test_the_readme_tour_runs_as_written(tmp_path: Path) -> None:
    lines = tour_block()
    script = tour_script(lines, free_port(), tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSHIP_")}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the tour failed:\n{output[-6000:]}"
    assert "node-1" in done.stdout, output[-3000:]
