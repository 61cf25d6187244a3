"""``python -m controlplane.k8s`` / ``weightship-operator``: run the ModelRollout operator.

Configured by environment (``OperatorConfig.from_env``): ``WEIGHTSHIP_URL`` and
``WEIGHTSHIP_TOKEN`` (an operator token) for the control plane, ``WEIGHTSHIP_OPERATOR_NAMESPACES``
(comma-separated; empty watches all), ``POD_NAME``/``POD_NAMESPACE`` for the Lease identity.
The Kubernetes API: ``WEIGHTSHIP_OPERATOR_KUBE_SERVER`` (a plain URL, tests) if set, else the pod's
ServiceAccount (``KUBERNETES_SERVICE_HOST``/``_PORT`` and the token and CA under
``/var/run/secrets/kubernetes.io/serviceaccount``, or ``WEIGHTSHIP_KUBE_SERVICE_ACCOUNT_DIR``),
else the kubeconfig.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from controlplane.k8s.operator import OperatorConfig, run
from weightship.logs import configure

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point; it takes no arguments but ``--help``, which prints the settings above."""
    summary, _, settings = (__doc__ or "").partition("\n\n")
    argparse.ArgumentParser(
        prog="weightship-operator",
        description=summary.split(": ", 1)[-1],
        epilog=settings,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    configure("info", root="controlplane")
    asyncio.run(run(OperatorConfig.from_env()))


if __name__ == "__main__":
    main()
