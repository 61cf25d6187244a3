"""The control plane: registry, pointers, fleet, rollouts, behind one FastAPI app.

Run it as ``weightship-controlplane`` (``python -m controlplane``); ``docs/architecture.md`` shows
its layers (an import-linter contract in ``pyproject.toml``). It imports only ``weightship`` (the
shared contract), never another component.

Modules (one line each; ``tests/test_module_maps.py`` keeps the map complete):

- ``__main__``: ``weightship-controlplane``: run the control plane, or migrate its database
- ``app``: The control plane's FastAPI application: wiring, error mapping, health and metrics
- ``auth``: Bearer-token authentication and role-based authorisation, and the node a token acts for
- ``authcache``: The per-process cache of authenticated tokens, with prompt revocation
- ``autoscaling``: Autoscaling signals: per deployment and version, what a scaler should react to, on ``/metrics``
- ``deployments``: Deployments and their serving pointers: create, read, compare-and-swap, roll back, audit
- ``fleet``: The fleet: node registry, heartbeats, desired state per node (with long-poll), deployment status
- ``heap``: The served process's garbage-collection policy: keep collection pauses out of request latency
- ``http/``: The control plane's HTTP layer: routers, FastAPI dependencies, request limits and request/response mapping
- ``k8s/``: The Kubernetes driver of the rollout engine: a kopf operator for the ``ModelRollout`` resource
- ``metrics``: Prometheus metrics of pointers and the fleet, registered on the app's own registry
- ``notify``: Change notification between control-plane processes: one watcher per process, no polling
- ``pacing``: Pacing the parked long-polls: when they expire, how fast a change wakes them, when they come back
- ``persistence/``: The control plane's persistence layer: SQL models and sessions, schema migrations, blob stores
- ``preheats``: Preheats and warm pools: create, list with progress, cancel; declare and drop a warm pool
- ``publish``: Publishing over REST: upload sessions, their parts, commit, and the expiry of abandoned ones
- ``recovery``: Disaster recovery: rebuild the version index from the origin store alone
- ``registry``: The version index: models, ready versions and their labels, and read access to their bytes
- ``rollout_driver``: The fleet rollout driver: observe the fleet, run the engine, move the pointer, store the status
- ``rollout_resources``: Rollout resources: create, read, list and act on rollouts of a deployment (``/v1/.../rollouts``)
- ``rollouts/``: Rollouts: a pure canary engine and the analysis arithmetic it judges versions with
- ``server``: The HTTP server process: uvicorn's, which on SIGTERM or SIGINT also answers parked long-polls
- ``settings``: Control-plane settings: environment variables with embedded defaults
- ``signatures``: A version's signatures: stored write-once beside its manifest, checked against the signing policy
- ``snapshot``: Shared, change-driven snapshots of what desired-state long-polls read: pointers and nodes
- ``staging``: Staging: which versions a node holds verified without serving them (preheats and warm pools)
- ``state``: The control plane's application state: every long-lived part a request may need, by name
- ``tickets``: Entitlement tickets: which node may fetch which versions from peers and caches, signed offline-checkable
- ``tokens``: API tokens: minting, listing and revoking them, and the bootstrap admin token
- ``traffic``: Per-version serving traffic across the fleet: samples of the model servers' counters and windows over them
- ``ui/``: The read-only status page at ``/ui/``: a fleet and its rollouts at a glance, live in a browser
- ``watcher``: The one change watcher each control-plane process runs for its lifetime
"""
