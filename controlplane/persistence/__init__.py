"""The control plane's persistence layer: SQL models and sessions, schema migrations, blob stores.

Nothing here knows about HTTP or about the domain rules above it (``controlplane.registry``,
``publish``, ``deployments``, ``fleet``, ``tokens``); the import-linter layers contract in
``pyproject.toml`` keeps it that way.
"""
