"""weightship: the shared contract of the model-weight distribution and rollout control plane.

This package holds what every component agrees on: the manifest format and digests, safetensors
header parsing, API schemas, the REST client and the ``weightship`` CLI. It never imports a
component (``controlplane``, ``agent``, ``gpu_loader``).
"""

__version__ = "0.1.0"
