"""gpu_loader: verified safetensors loading onto GPUs (or CPU), validation hooks, a reference server.

The loading API is what model servers and tools import::

    from gpu_loader import Loader, LoadOptions, ShardSpec, load_state_dict, load_into_module

    tensors = load_state_dict("/var/lib/weightship/versions/<hex>", device="cuda:0", verify="fast")

See ``gpu_loader.loader`` for the verification modes and ``docs/loading.md`` for the pipeline.

Modules (one line each; ``tests/test_module_maps.py`` keeps the map complete):

- ``agent_api``: Client of the agent's local API, as a model server uses it
- ``api``: Request and response bodies of the OpenAI-style routes of ``weightship-serve``
- ``checksums``: The host-local CRC32 record that ``verify="fast"`` checks against
- ``dtypes``: Safetensors dtype names to torch dtypes, and which casts the loader makes
- ``errors``: Errors gpu_loader raises, each a subclass of the shared ``weightship.errors`` tree
- ``golden``: The golden file: a model-specific smoke check that ships inside the version
- ``hf``: Any model ``transformers`` can build from its ``config.json``, built on ``meta`` and loaded by gpu_loader
- ``inference``: What a served model computes for a request: greedy completions, embeddings, raw next tokens
- ``loader``: The public loading API: a version directory in, verified tensors on a device out
- ``metrics``: Prometheus metrics of the reference model server
- ``model``: The reference model: a small but real Llama-style decoder, laid out like Hugging Face's
- ``modelgen``: Generate a small real Llama-style model in HF layout, with its golden validation file
- ``pipeline``: Running a load plan: reader threads, the hash pool, and tensors handed out as they complete
- ``plan``: The load plan: which bytes to read, where each lands, and which reads make each tensor whole
- ``pooling``: Sentence embeddings from token states, as sentence-transformers computes them
- ``serve``: ``weightship-serve``: the reference model server
- ``serving``: What the server serves: a loaded, validated model, and the slot that swaps models atomically
- ``sharding``: Tensor-parallel row (dim 0) splits, planned as byte ranges
- ``staging``: A ring of host buffers that reads land in before they go on: to a GPU, or to a cast
- ``streamfeed``: Streaming a version from the agent: follow its chunk feed and load while it is still fetched
- ``streaming``: Streaming loads: tensors loaded as the chunks that hold them are verified, in any order
- ``targets``: Where read bytes land: straight into CPU tensors, through pinned staging onto a GPU, or mapped
- ``validation``: Validation hooks run on a loaded model before it may serve
- ``variants``: New versions of an existing checkpoint, for rollout rehearsals: a nudged copy and a NaN-poisoned one
- ``verifying``: Checking a chunk while it is read: SHA-256 against the manifest, or CRC32 against a record
- ``version``: A version directory opened for loading
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
