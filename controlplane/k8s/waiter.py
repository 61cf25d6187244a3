"""The init container of every model-server pod: wait until the node's agent holds the version verified.

``python -m controlplane.k8s.waiter`` polls the agent's local API (``GET /local/v1/status``, the
agent's report, see ``docs/agent.md``) at ``WEIGHTSHIP_AGENT_URL`` until the inventory lists
``WEIGHTSHIP_DIGEST`` as ``ready`` — a node marks a version ready only from bytes it hashed itself
— then exits 0 and the model server starts. A version the agent reports ``failed`` is logged with
the agent's reason and waited on further (the agent retries with backoff). Standard library only,
so the wait costs no start-up time.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

__all__ = ["main", "version_state"]


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
    url = os.environ.get("WEIGHTSHIP_AGENT_URL", "http://127.0.0.1:7070").rstrip("/") + "/local/v1/status"
    interval = float(os.environ.get("WEIGHTSHIP_WAIT_INTERVAL", "2"))
    if not digest.startswith("sha256:"):
        print("waiter.misconfigured reason='WEIGHTSHIP_DIGEST is not set to a sha256: digest'", flush=True)
        return 2
    last = ""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310  # the node's own agent
                state, error = version_state(json.load(answer), digest)
        except (OSError, ValueError) as exc:
            state, error = "unreachable", str(exc)
        if state == "ready":
            print(f"waiter.ready digest={digest}", flush=True)
            return 0
        if state != last:
            print(f"waiter.waiting digest={digest} state={state} error={error!r} agent={url}", flush=True)
            last = state
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
