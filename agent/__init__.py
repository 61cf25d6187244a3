"""weightship node agent: verified fetch, versions side by side, atomic switches, a local API.

Run it as ``weightship-agent`` (``python -m agent``); ``docs/agent.md`` describes the on-disk
layout, the states, retention and the local API. The agent imports only ``weightship`` (the
shared contract), never another component.

Modules (one line each; ``tests/test_module_maps.py`` keeps the map complete):

- ``__main__``: ``weightship-agent`` / ``python -m agent``: run the node agent until SIGTERM or SIGINT
- ``assemble``: Assembling one version end to end, from manifest to an installed ``versions/<hex>/``
- ``bandwidth``: Bandwidth caps: a token bucket that paces bytes sent or received to a configured rate
- ``cache``: The cache role: a read-through chunk cache for a cluster or a region, by chunk digest
- ``chunkfeed``: The chunk feed: the verified chunks of a version still being fetched, in arrival order
- ``chunkorder``: A version's chunk numbering, shared by announcers, the tracker and the fetcher
- ``chunkstore``: A cache's chunk store: verified chunks on disk by digest, crash-safe, bounded with LRU and pins
- ``config``: Agent configuration: a file, the environment and flags, in rising order of precedence
- ``controlplane_client``: The agent's calls to the control plane: enrol, register, heartbeat, desired state, blob URLs, manifests, tickets
- ``counters``: Byte and chunk counters of one agent run; what the heartbeat reports and the demo prints
- ``daemon``: The agent process: wiring, and the loops that talk to the control plane
- ``durable``: Durable file-system steps: atomic replacement, fsync of files and directories
- ``durability``: Durability off the readiness path: a version is ready once verified, and made durable just after
- ``epochs``: Anti-rollback: the highest pointer epoch accepted per deployment, persisted across restarts
- ``fetcher``: Fetching a version's missing chunks: local copies first, then HTTP range requests on blob URLs
- ``hookcalls``: Switch hooks: how one is configured, and one call of it (a command, a signal, an HTTP POST)
- ``identity``: The node's own credential: the node token that enrolment returned, kept in the data directory
- ``listenerbounds``: Bounds on the peer listener's connections: how many, how long idle, and how much it logs about them
- ``localapi``: The local API for model servers on this host: what to serve, waiting for switches, validation
- ``metricsserver``: The agent's metrics for Prometheus, wherever it can scrape them
- ``peerserver``: The peer listener: chunks this agent verified, served by digest to holders of a ticket
- ``pins``: Pins: the versions that model servers on this host ask for by digest, and hold while they serve them
- ``problems``: The agent's one error boundary: every error its listeners answer is RFC 9457 problem details
- ``rangeclient``: HTTP/1.1 range reads straight into chunk buffers: the agent's blob transport
- ``reconcile``: Reconcile: turning the desired state into what this node holds on disk and serves
- ``retention``: Retention: what stays on disk within the quota, what is evicted, and when the disk is full
- ``servemetrics``: Model servers' serving counters on this node, summed per deployment and version for the heartbeat
- ``serving``: What each deployment serves on this node, as model servers see it, and waiting for switches
- ``signatures``: The node's signature gate: a version is fetched only when the node's own policy accepts it
- ``sources``: Where a node gets a chunk, nearest first: local → peers (via the tracker) → cluster cache → region cache → origin
- ``staging``: Assembling one version: a staging directory plus a journal of verified chunks (crash-safe)
- ``store``: The local version store: versions side by side on disk, and per-deployment ``current`` links
- ``switchhooks``: Switch hooks: telling an external model server (vLLM, TGI, SGLang, Triton) that its version moved
- ``tickets``: The agent's side of entitlement: the control plane's public keys, and this node's own ticket
- ``tracker``: The cluster tracker's algorithm: who holds which chunks, and whom a node should fetch from
- ``tracker_api``: The tracker's HTTP routes, mounted on the cluster cache's peer listener (``PeerServer``)
- ``tracker_limits``: What bounds the work one node makes the tracker do: a request rate per node, cached misses, checked addresses
- ``verifier``: Verification: every chunk is checked against the manifest before it is placed or trusted
"""
