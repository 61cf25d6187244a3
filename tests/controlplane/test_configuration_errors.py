"""Start-up and configuration errors stop ``weightship-controlplane`` with one clear line and exit status 1.

A wrong database URL, store URL or setting must not surface as a traceback from inside the
server's start-up (uvicorn's "Application startup failed", exit 3): the process names the
variable, says what is wrong with it and what to do, and never prints a password.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.controlplane.startup_parts import _env
from weightship.testing import free_port

pytestmark = pytest.mark.timeout(120)

#: (environment, command, what the one line must name)
CASES: list[tuple[dict[str, str], str, str]] = [
    ({"WEIGHTSHIP_DATABASE_URL": "nonsense"}, "serve", "WEIGHTSHIP_DATABASE_URL is not a database URL"),
    ({"WEIGHTSHIP_DATABASE_URL": "nonsense"}, "migrate", "WEIGHTSHIP_DATABASE_URL is not a database URL"),
    (
        {"WEIGHTSHIP_DATABASE_URL": "postgresql+psycopg://nobody:hunter2@127.0.0.1:1/x"},
        "serve",
        "cannot open the database postgresql+psycopg://nobody:***@127.0.0.1:1/x",
    ),
    # {tmp}/a-file is a file, so no directory can be made there
    ({"WEIGHTSHIP_DATABASE_URL": "sqlite:///{tmp}/a-file/cp.db"}, "serve", "cannot open the database"),
    ({"WEIGHTSHIP_STORE": "ftp://example.com/weights"}, "serve", "WEIGHTSHIP_STORE"),
    ({"WEIGHTSHIP_UPLOAD_TTL": "a day"}, "serve", "WEIGHTSHIP_UPLOAD_TTL is 'a day', not a whole number"),
    ({"WEIGHTSHIP_NODE_STALE_SECONDS": "nan"}, "serve", "WEIGHTSHIP_NODE_STALE_SECONDS"),
    ({"WEIGHTSHIP_PORT": "http"}, "serve", "WEIGHTSHIP_PORT is 'http', not a port number"),
]


@pytest.mark.parametrize(
    ("extra", "command", "says"), CASES, ids=[f"{c}-{next(iter(e))}-{e[next(iter(e))][:12]}" for e, c, _ in CASES]
)
def test_a_bad_setting_stops_the_control_plane_with_one_line(
    tmp_path: Path, extra: dict[str, str], command: str, says: str
) -> None:
    argv = [sys.executable, "-m", "controlplane", command] + (
        ["--port", str(free_port())] if command == "serve" else []
    )
    if "WEIGHTSHIP_PORT" in extra:
        argv = argv[:4]  # the port then comes from the environment
    (tmp_path / "a-file").write_text("not a directory")
    extra = {name: value.replace("{tmp}", str(tmp_path)) for name, value in extra.items()}
    done = subprocess.run(
        argv, cwd=tmp_path, env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert says in errors[0], errors[0]
    assert "hunter2" not in done.stderr
