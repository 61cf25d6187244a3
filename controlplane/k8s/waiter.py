"""The init container of every model-server pod: wait until the node's agent holds the version verified.

``python -m controlplane.k8s.waiter`` asks the agent's local API at ``WEIGHTSHIP_AGENT_URL`` —
``unix:/run/weightship/agent.sock`` (the chart's agent listens on that socket, in a host directory
the pod mounts) or an ``http://host:port`` URL — for ``WEIGHTSHIP_DIGEST`` as a version of
``WEIGHTSHIP_DEPLOYMENT``, long-polling ``GET /local/v1/versions/{digest}/wait`` (see
``docs/agent.md``). Asking is also a request to stage it: the agent follows that deployment and
fetches the version when the deployment's pointer names it. Once the agent says ``ready`` — a node
marks a version ready only from bytes it hashed itself — the waiter exits 0 and the model server
starts. Each change of state (fetching, failed with the agent's reason, unknown with why) is
printed once.

It gives up after ``WEIGHTSHIP_WAIT_DEADLINE`` seconds (default 1800; 0: never) with exit status 1
and one line naming what it waited for: the digest, the deployment, the agent's address, and the
last state and reason; Kubernetes then restarts it with its back-off, so the pod shows the reason
in its events instead of hanging silently. An agent without the ``versions`` route (an older one,
during an upgrade) is polled on ``GET /local/v1/status`` instead, as before. Standard library only,
so the wait costs no start-up time.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["WaitSettings", "ask_version", "fetch_report", "main", "version_state", "wait"]

_STATUS = "/local/v1/status"
#: default seconds before giving up
DEFAULT_DEADLINE = 1800.0


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


class _NoRoute(Exception):
    """The agent does not know the route (an older agent)."""


def _get(agent: str, path: str, timeout: float) -> Any:
    """GET ``path`` on the agent; the JSON body. 404: ``_NoRoute``; any other non-200: ``OSError``."""
    if agent.startswith("unix:"):
        connection = _UnixConnection(agent.removeprefix("unix:"), timeout)
        try:
            connection.request("GET", path)
            answer = connection.getresponse()
            body = answer.read()
            status = answer.status
        finally:
            connection.close()
    else:
        try:
            with urllib.request.urlopen(agent.rstrip("/") + path, timeout=timeout) as response:  # noqa: S310  # the node's own agent
                body, status = response.read(), response.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read(), exc.code
            exc.close()
    if status == 404:
        raise _NoRoute(path)
    if status != 200:
        detail = ""
        with contextlib.suppress(ValueError, AttributeError):
            detail = str(json.loads(body).get("detail", ""))
        raise OSError(f"the agent answered HTTP {status}" + (f": {detail}" if detail else ""))
    return json.loads(body)


def fetch_report(agent: str, timeout: float = 10.0) -> Any:
    """The agent's report from ``agent`` (``unix:/path/agent.sock`` or ``http://host:port``)."""
    return _get(agent, _STATUS, timeout)


def version_state(report: object, digest: str) -> tuple[str, str]:
    """(state, error) of ``digest`` in an agent's ``NodeHeartbeat`` report; ``("absent", "")`` if not there."""
    inventory = report.get("inventory", []) if isinstance(report, dict) else []
    for item in inventory:
        if isinstance(item, dict) and item.get("digest") == digest:
            return str(item.get("state", "")), str(item.get("error") or "")
    return "absent", ""


def ask_version(agent: str, digest: str, deployment: str, seconds: float) -> tuple[str, str]:
    """(state, reason) of ``digest`` once ready, or after ``seconds`` (``LocalVersion`` from the long-poll)."""
    query = urllib.parse.urlencode({"timeout": f"{seconds:g}", **({"deployment": deployment} if deployment else {})})
    path = f"/local/v1/versions/{urllib.parse.quote(digest, safe='')}/wait?{query}"
    answer = _get(agent, path, seconds + 10.0)
    if not isinstance(answer, dict):
        raise ValueError("the agent's answer is not a JSON object")
    return str(answer.get("state", "")), str(answer.get("reason") or "")


@dataclass(frozen=True)
class WaitSettings:
    """What to wait for, where, and for how long (from the environment)."""

    digest: str
    deployment: str
    agent: str
    interval: float = 10.0
    deadline: float = DEFAULT_DEADLINE


def wait(settings: WaitSettings, clock: Any = time.monotonic) -> int:
    """Wait for the version; 0 once ready, 1 when the deadline passed first."""
    s = settings
    started = clock()
    last: tuple[str, str] = ("", "")
    legacy = False
    while True:
        remaining = s.deadline - (clock() - started) if s.deadline > 0 else s.interval
        if remaining <= 0:
            state, reason = last
            print(
                f"waiter.gave_up digest={s.digest} deployment={s.deployment or '-'} agent={s.agent} "
                f"waited={s.deadline:g}s state={state or 'none'} reason={reason!r}: the node's agent does not hold "
                "this version verified; see the reason, 'kubectl describe mro', and the agent's log on this node "
                "(raise WEIGHTSHIP_WAIT_DEADLINE for very large versions)",
                flush=True,
            )
            return 1
        step = max(0.05, min(s.interval, remaining))
        polled = False
        try:
            if not legacy:
                try:
                    state, reason = ask_version(s.agent, s.digest, s.deployment, step)
                    polled = True  # a long-poll: it already waited
                except _NoRoute:
                    legacy = True
                    print(f"waiter.legacy_agent agent={s.agent}: polling {_STATUS}", flush=True)
            if legacy:
                state, reason = version_state(fetch_report(s.agent), s.digest)
        except (OSError, ValueError, http.client.HTTPException, _NoRoute) as exc:
            state, reason = "unreachable", str(exc) or type(exc).__name__
            polled = False
        if state == "ready":
            print(f"waiter.ready digest={s.digest}", flush=True)
            return 0
        if (state, reason) != last:
            print(
                f"waiter.waiting digest={s.digest} deployment={s.deployment or '-'} state={state} "
                f"reason={reason!r} agent={s.agent}",
                flush=True,
            )
            last = (state, reason)
        if not polled:
            time.sleep(step)


def main() -> int:
    """Wait for the version; exit 0 once it is verified on this node, 1 at the deadline, 2 if misconfigured."""
    digest = os.environ.get("WEIGHTSHIP_DIGEST", "")
    try:
        interval = float(os.environ.get("WEIGHTSHIP_WAIT_INTERVAL", "10"))
        deadline = float(os.environ.get("WEIGHTSHIP_WAIT_DEADLINE", f"{DEFAULT_DEADLINE:g}"))
    except ValueError:
        print("waiter.misconfigured reason='WEIGHTSHIP_WAIT_INTERVAL and WEIGHTSHIP_WAIT_DEADLINE are seconds'")
        return 2
    if not digest.startswith("sha256:"):
        print("waiter.misconfigured reason='WEIGHTSHIP_DIGEST is not set to a sha256: digest'", flush=True)
        return 2
    settings = WaitSettings(
        digest=digest,
        deployment=os.environ.get("WEIGHTSHIP_DEPLOYMENT", ""),
        agent=os.environ.get("WEIGHTSHIP_AGENT_URL", "unix:/run/weightship/agent.sock"),
        interval=max(0.05, interval),
        deadline=max(0.0, deadline),
    )
    return wait(settings)


if __name__ == "__main__":
    sys.exit(main())
