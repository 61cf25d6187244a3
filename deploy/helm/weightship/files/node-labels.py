"""Copy this node's Kubernetes labels into the weightship agent's labels.

Runs as the agent pod's init container: reads the Node named by $NODE_NAME from the API server
with the pod's ServiceAccount, maps labels per $WEIGHTSHIP_LABEL_MAP (JSON: agent label -> node
label) and writes the agent's config file ($1, JSON: {"labels": {...}}). A node label that is
missing leaves that agent label at the agent's default. Standard library only.
"""

import json
import os
import ssl
import sys
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"


def main(out: str) -> int:
    node = os.environ["NODE_NAME"]
    mapping = json.loads(os.environ.get("WEIGHTSHIP_LABEL_MAP", "{}"))
    api = os.environ.get("KUBERNETES_API_URL") or "https://{}:{}".format(
        os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    )
    request = urllib.request.Request(f"{api}/api/v1/nodes/{node}")  # noqa: S310 (http(s) API server URL)
    context = None
    if api.startswith("https://"):
        context = ssl.create_default_context(cafile=os.environ.get("KUBERNETES_CA_FILE", f"{SA}/ca.crt"))
    token_file = os.environ.get("KUBERNETES_TOKEN_FILE", f"{SA}/token")
    if os.path.exists(token_file):
        with open(token_file, encoding="utf-8") as f:
            request.add_header("Authorization", "Bearer " + f.read().strip())
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:  # noqa: S310
            labels = json.load(response).get("metadata", {}).get("labels") or {}
    except OSError as exc:
        print(f"node-labels: cannot read node {node} from {api}: {exc}; check the agent's RBAC (get nodes)", file=sys.stderr)
        return 1
    found = {key: labels[name] for key, name in mapping.items() if name and labels.get(name)}
    cluster = os.environ.get("WEIGHTSHIP_CLUSTER_NAME")
    if cluster:
        found["cluster"] = cluster
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"labels": found}, f, sort_keys=True)
    os.replace(tmp, out)
    print("node-labels node={} labels={}".format(node, ",".join(f"{k}={v}" for k, v in sorted(found.items()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
