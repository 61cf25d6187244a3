"""weightship: the shared contract of the model-weight distribution and rollout control plane.

This package holds what every component agrees on: the manifest format and digests, safetensors
header parsing, API schemas, the REST client and the ``weightship`` CLI. It never imports a
component (``controlplane``, ``agent``, ``gpu_loader``).

Modules (one line each; ``tests/test_module_maps.py`` keeps the map complete):

- ``addresses``: Which peer addresses a node may announce: never link-local or cloud metadata, and inside the cluster's network
- ``backoff``: The one retry engine: capped exponential backoff with jitter, driven by the error's kind
- ``buffers``: Buffers for reading files: a fixed pool of them, and the one way to fill one exactly
- ``chunkfeed``: The chunk feed's contract: which chunks of a version still being fetched a model server may read
- ``chunks``: Chunk geometry and parallel chunk hashing
- ``cli/``: The ``weightship`` command line (entry point ``weightship.cli:main``)
- ``client``: The REST client of the control plane: one typed method per route, built on the HTTP core
- ``digests``: The one place digests are computed and parsed
- ``errors``: One rooted exception tree for every weightship error
- ``http``: The HTTP core every weightship client is built on: one request path, sync and async
- ``layout``: The on-disk layout of a version on a node, shared by the agent (writer) and model servers
- ``logs``: Structured logs for every component: one event name, then ``key=value`` fields
- ``manifest``: Manifest v1: the one module that builds, serialises, parses and validates a version's manifest
- ``modelrollout``: The ``ModelRollout`` resource as a contract between the operator and its users
- ``problems``: Reading an HTTP error answer into our exception tree: the one error mapping of every client
- ``publishing``: Publishing a model directory: hash it, upload only what the store lacks, commit
- ``safetensors_header``: Parsing and validating the safetensors header
- ``schemas/``: HTTP schemas: the one definition of every request and response body weightship exchanges
- ``signing``: Signed versions in the OpenSSF model-signing format, built from and checked against the manifest
- ``signing_policy``: Trust policy: which signatures a model's versions need, read from a file the node's operator owns
- ``sizes``: Byte sizes for people (``500M``, ``64MiB``, ``1.5G``): the one parser and the one formatter, binary units
- ``testing/``: Helpers that weightship's tests and benchmarks share, public for anyone testing against weightship
- ``tickets``: Entitlement tickets: short-lived, ed25519-signed capabilities to fetch chunks of named versions
"""

__version__ = "0.1.0"
