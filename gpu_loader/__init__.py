"""gpu_loader: verified safetensors loading onto GPUs (or CPU), validation hooks, a reference server.

The loading API is what model servers and tools import::

    from gpu_loader import Loader, LoadOptions, ShardSpec, load_state_dict, load_into_module

    tensors = load_state_dict("/var/lib/weightship/versions/<hex>", device="cuda:0", verify="fast")

See ``gpu_loader.loader`` for the verification modes and ``docs/loading.md`` for the pipeline.
"""

from gpu_loader.loader import (
    Loader,
    LoadOptions,
    LoadResult,
    LoadSession,
    LoadStats,
    VerifyMode,
    load_into_module,
    load_state_dict,
)
from gpu_loader.sharding import ShardSpec

__all__ = [
    "LoadOptions",
    "LoadResult",
    "LoadSession",
    "LoadStats",
    "Loader",
    "ShardSpec",
    "VerifyMode",
    "load_into_module",
    "load_state_dict",
]
