"""``python -m controlplane.k8s`` / ``weightship-operator``: run the ModelRollout operator.

Configured by environment (``OperatorConfig.from_env``): ``WEIGHTSHIP_URL`` and
``WEIGHTSHIP_TOKEN`` (an operator token) for the control plane, ``WEIGHTSHIP_OPERATOR_NAMESPACES``
(comma-separated; empty watches all), ``POD_NAME``/``POD_NAMESPACE`` for the Lease identity.
"""

from __future__ import annotations

import asyncio

from controlplane.k8s.operator import OperatorConfig, run
from weightship.logs import configure

__all__ = ["main"]


def main() -> None:
    """Entry point."""
    configure("info", root="controlplane")
    asyncio.run(run(OperatorConfig.from_env()))


if __name__ == "__main__":
    main()
