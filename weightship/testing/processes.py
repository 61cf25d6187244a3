"""Ending processes that tests started: a crash (``kill9``) or a clean stop (``terminate``)."""

from __future__ import annotations

import signal
import subprocess

__all__ = ["kill9", "terminate"]


def kill9(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL and reap: no clean-up of any kind, as a crash or an OOM kill."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def terminate(proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM and wait ``grace`` seconds, then SIGKILL; nothing to do if it already exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
