"""The init container of every model-server pod: wait until the node's agent holds the version verified.

``python -m controlplane.k8s.waiter`` polls the agent's local API (``GET /local/v1/status``, the
agent's report, see ``docs/agent.md``) at ``WEIGHTSHIP_AGENT_URL`` — ``unix:/run/weightship/agent.sock``
(the chart's agent listens on that socket, in a host directory the pod mounts) or an
``http://host:port`` URL — until the inventory lists
``WEIGHTSHIP_DIGEST`` as ``ready`` — a node marks a version ready only from bytes it hashed itself
— then exits 0 and the model server starts. A version the agent reports ``failed`` is logged with
the agent's reason and waited on further (the agent retries with backoff). Standard library only,
so the wait costs no start-up time.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
import urllib.request
from typing import Any

__all__ = ["fetch_report", "main", "version_state"]

_PATH = "/local/v1/status"


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the agent's local API on the node)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def fetch_report(agent: str, timeout: float = 10.0) -> Any:
    """The agent's report from ``agent`` (``unix:/path/agent.sock`` or ``http://host:port``)."""
    if agent.startswith("unix:"):
        connection = _UnixConnection(agent.removeprefix("unix:"), timeout)
        try:
            connection.request("GET", _PATH)
            answer = connection.getresponse()
            if answer.status != 200:
                raise OSError(f"the agent answered HTTP {answer.status}")
            return json.load(answer)
        finally:
            connection.close()
    with urllib.request.urlopen(agent.rstrip("/") + _PATH, timeout=timeout) as answer:  # noqa: S310  # the node's own agent
        return json.load(answer)


def version_state(report: object, digest: str) -> tuple[str, str]:
    """(state, error) of ``digest`` in an agent's ``NodeHeartbeat`` report; ``("absent", "")`` if not there."""
    inventory = report.get("inventory", []) if isinstance(report, dict) else []
    for item in inventory:
        if isinstance(item, dict) and item.get("digest") == digest:
            return str(item.get("state", "")), str(item.get("error") or "")
    return "absent", ""


def main() -> int:
    """Wait for the version; exit 0 once it is verified on this node."""
    digest = os.environ.get("WEIGHTSHIP_DIGEST", "")
    agent = os.environ.get("WEIGHTSHIP_AGENT_URL", "unix:/run/weightship/agent.sock")
    interval = float(os.environ.get("WEIGHTSHIP_WAIT_INTERVAL", "2"))
    if not digest.startswith("sha256:"):
        print("waiter.misconfigured reason='WEIGHTSHIP_DIGEST is not set to a sha256: digest'", flush=True)
        return 2
    last = ""
    while True:
        try:
            state, error = version_state(fetch_report(agent), digest)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            state, error = "unreachable", str(exc) or type(exc).__name__
        if state == "ready":
            print(f"waiter.ready digest={digest}", flush=True)
            return 0
        if state != last:
            print(f"waiter.waiting digest={digest} state={state} error={error!r} agent={agent}", flush=True)
            last = state
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
