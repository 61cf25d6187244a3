"""Rollouts: a pure canary engine and the analysis arithmetic it judges versions with.

Everything in this package is free of I/O and of clocks, so a rollout's behaviour is a function of
its spec, its stored status, what the driver observed and the time the driver passes in. The REST
resources, the fleet and Kubernetes drivers, the metric providers and the CLI build on it
(``docs/rollouts.md``).
"""
