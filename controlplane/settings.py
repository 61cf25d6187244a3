"""Control-plane settings: environment variables with embedded defaults.

Every setting has a default that runs the control plane on one machine with no outside
services: SQLite under ``./.weightship`` and a local-directory origin store.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from weightship.errors import ValidationError

__all__ = ["Settings"]


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


_N = TypeVar("_N", int, float)


def _number(name: str, default: str, kind: type[_N]) -> _N:
    """The number in environment variable ``name``; a ``ValidationError`` naming it when it is not one."""
    text = _env(name, default)
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ValidationError(f"{name} is {text!r}, not {what}: set it to one (default {default}) or unset it") from None
    if not value >= 0:  # also refuses NaN
        raise ValidationError(f"{name} is {text!r}: it must be 0 or more (default {default})")
    return value


@dataclass(frozen=True)
class Settings:
    """Everything the control plane is configured with."""

    #: SQLAlchemy URL; ``sqlite:///path`` (default) or ``postgresql+psycopg://...``
    database_url: str = field(
        default_factory=lambda: _env("WEIGHTSHIP_DATABASE_URL", "sqlite:///.weightship/controlplane.db")
    )
    #: ``local:/path`` (default) or ``s3://bucket[/prefix]``
    store_url: str = field(default_factory=lambda: _env("WEIGHTSHIP_STORE", "local:.weightship/origin"))
    #: S3 endpoint (moto, MinIO); empty means AWS
    s3_endpoint_url: str = field(default_factory=lambda: _env("WEIGHTSHIP_S3_ENDPOINT_URL", ""))
    s3_region: str = field(default_factory=lambda: _env("WEIGHTSHIP_S3_REGION", "us-east-1"))
    #: bootstrap admin token; its hash is stored at start-up. Empty: none is created.
    admin_token: str = field(default_factory=lambda: _env("WEIGHTSHIP_ADMIN_TOKEN", ""))
    #: directory of bootstrap tokens, one file per role named after it (``agent``, ``operator``,
    #: ``publisher``, ``admin``; a mounted Secret's keys): each file's token is stored hashed at
    #: start-up as ``bootstrap-<role>`` (``controlplane.tokens.bootstrap_tokens``). Empty: none.
    bootstrap_tokens_dir: str = field(default_factory=lambda: _env("WEIGHTSHIP_BOOTSTRAP_TOKENS_DIR", ""))
    #: signing policy file (``weightship.signing_policy``), checked at publish and pointer moves; empty: none
    signing_policy_file: str = field(default_factory=lambda: _env("WEIGHTSHIP_SIGNING_POLICY", ""))
    #: key for signing blob URLs the control plane serves itself (local store)
    url_signing_key: str = field(default_factory=lambda: _env("WEIGHTSHIP_URL_SIGNING_KEY", secrets.token_hex(32)))
    #: base URL at which agents and clients reach this control plane; ``serve`` derives it from the
    #: address it binds when WEIGHTSHIP_PUBLIC_URL is unset (this default serves in-process apps)
    public_url: str = field(default_factory=lambda: _env("WEIGHTSHIP_PUBLIC_URL", "http://127.0.0.1:8080"))
    upload_ttl_seconds: int = field(default_factory=lambda: _number("WEIGHTSHIP_UPLOAD_TTL", "86400", int))
    #: how often abandoned publish sessions are looked for and aborted
    upload_sweep_seconds: float = field(default_factory=lambda: _number("WEIGHTSHIP_UPLOAD_SWEEP_SECONDS", "300", float))
    blob_url_ttl_seconds: int = field(default_factory=lambda: _number("WEIGHTSHIP_BLOB_URL_TTL", "3600", int))
    node_stale_seconds: float = field(default_factory=lambda: _number("WEIGHTSHIP_NODE_STALE_SECONDS", "30", float))
    #: how often the fleet's serving counters are sampled (analysis windows and autoscaling gauges start at one)
    serve_sample_seconds: float = field(default_factory=lambda: _number("WEIGHTSHIP_SERVE_SAMPLE_SECONDS", "10", float))
    #: the window the autoscaling gauges' rates and latency quantiles cover (``controlplane.autoscaling``)
    signal_window_seconds: float = field(
        default_factory=lambda: _number("WEIGHTSHIP_SIGNAL_WINDOW_SECONDS", "60", float)
    )
    #: how long samples are kept: the longest analysis window (built-in provider ``window``) must fit
    serve_sample_retention_seconds: float = field(
        default_factory=lambda: _number("WEIGHTSHIP_SERVE_SAMPLE_RETENTION_SECONDS", "3600", float)
    )
    long_poll_max_seconds: float = field(default_factory=lambda: _number("WEIGHTSHIP_LONG_POLL_MAX", "30", float))
    #: how long a statement waits for a database lock (SQLite busy timeout, PostgreSQL lock_timeout)
    #: before the request fails fast with 503 + Retry-After instead of stalling
    database_lock_timeout_seconds: float = field(
        default_factory=lambda: _number("WEIGHTSHIP_DATABASE_LOCK_TIMEOUT", "2", float)
    )
    #: how long a request waits for a free pooled connection before answering 503
    database_pool_timeout_seconds: float = field(
        default_factory=lambda: _number("WEIGHTSHIP_DATABASE_POOL_TIMEOUT", "3", float)
    )
    #: pooled connections kept open (PostgreSQL and SQLite files); up to as many again on bursts
    database_pool_size: int = field(default_factory=lambda: _number("WEIGHTSHIP_DATABASE_POOL_SIZE", "10", int))
    #: PostgreSQL ``statement_timeout``: no single statement may run longer than this
    database_statement_timeout_seconds: float = field(
        default_factory=lambda: _number("WEIGHTSHIP_DATABASE_STATEMENT_TIMEOUT", "30", float)
    )
    #: lifetime of an entitlement ticket (``controlplane.tickets``); agents renew at half of it
    ticket_ttl_seconds: int = field(default_factory=lambda: int(_env("WEIGHTSHIP_TICKET_TTL", "600")))
    #: largest request body accepted on routes without a limit of their own (``controlplane.limits``)
    max_body_bytes: int = field(default_factory=lambda: _number("WEIGHTSHIP_MAX_BODY_BYTES", str(64 * 1024), int))

    #: how often this process's rollout driver reconciles the active rollouts it leases; 0: no driver
    rollout_tick_seconds: float = field(default_factory=lambda: _number("WEIGHTSHIP_ROLLOUT_TICK_SECONDS", "2", float))
    #: how long a rollout's lease lasts unless renewed; another process takes it over after that
    rollout_lease_seconds: float = field(
        default_factory=lambda: _number("WEIGHTSHIP_ROLLOUT_LEASE_SECONDS", "15", float)
    )

    def local_store_path(self) -> Path | None:
        """The directory of a ``local:`` store, else ``None``."""
        if self.store_url.startswith("local:"):
            return Path(self.store_url.removeprefix("local:"))
        return None
