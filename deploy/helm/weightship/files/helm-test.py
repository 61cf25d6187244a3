"""`helm test`: the control plane answers, one agent talks to it, and the operator is alive and let in.

Runs in the test hook's pod (templates/tests/connection.yaml), standard library only. Checks, each
polled until $WEIGHTSHIP_TEST_TIMEOUT seconds have passed:

1. the control plane's /readyz answers 200 ($WEIGHTSHIP_URL);
2. the operator's token ($WEIGHTSHIP_TOKEN, the one the operator pods use) is accepted: GET /v1/nodes;
3. at least one agent has enrolled and heartbeats (a node in that list that is not stale), unless
   $WEIGHTSHIP_TEST_AGENT is 0;
4. the operator's liveness endpoint answers 200 ($WEIGHTSHIP_TEST_OPERATOR_URL; empty: no operator).

Prints one line per check; exits 1 naming the first check that did not pass in time.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request


def get(url: str, token: str = "") -> tuple[int, bytes]:
    request = urllib.request.Request(url)  # noqa: S310 (http URLs of the release's own Services)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError as err:
        return 0, str(err).encode()


def main() -> int:
    cp = os.environ["WEIGHTSHIP_URL"].rstrip("/")
    token = os.environ["WEIGHTSHIP_TOKEN"].strip()
    operator = os.environ.get("WEIGHTSHIP_TEST_OPERATOR_URL", "")
    want_agent = os.environ.get("WEIGHTSHIP_TEST_AGENT", "1") != "0"
    deadline = time.monotonic() + float(os.environ.get("WEIGHTSHIP_TEST_TIMEOUT", "300"))
    interval = float(os.environ.get("WEIGHTSHIP_TEST_INTERVAL", "2"))

    def readyz() -> str:
        status, body = get(f"{cp}/readyz")
        return "" if status == 200 else f"GET {cp}/readyz answered {status}: {body[:200]!r}"

    def operator_token() -> str:
        status, body = get(f"{cp}/v1/nodes", token)
        return "" if status == 200 else f"the operator's token was refused by {cp} ({status}): {body[:200]!r}"

    def agent() -> str:
        status, body = get(f"{cp}/v1/nodes", token)
        nodes = json.loads(body) if status == 200 else []
        live = [n["name"] for n in nodes if not n.get("stale") and n.get("role", "node") == "node"]
        if live:
            print(f"helm-test: agent on node {live[0]} heartbeats ({len(live)} live nodes)")
            return ""
        return f"no agent has enrolled and heartbeats at {cp} (nodes: {[n['name'] for n in nodes]})"

    def operator_alive() -> str:
        status, body = get(operator)
        return "" if status == 200 else f"the operator's liveness endpoint {operator} answered {status}: {body[:200]!r}"

    checks = [("control plane ready", readyz), ("operator token accepted", operator_token)]
    if want_agent:
        checks.append(("agent enrolled and heartbeating", agent))
    if operator:
        checks.append(("operator alive", operator_alive))
    for name, check in checks:
        while True:
            problem = check()
            if not problem:
                print(f"helm-test: ok: {name}")
                break
            if time.monotonic() > deadline:
                print(f"helm-test: FAILED: {name}: {problem}", file=sys.stderr)
                return 1
            time.sleep(interval)  # ok-sleep: polling interval of a deadline loop
    return 0


if __name__ == "__main__":
    sys.exit(main())
