"""Agent configuration: a file, the environment and flags, in rising order of precedence.

The file is TOML (``*.toml``) or JSON (anything else), with the keys of ``AgentConfig`` at the
top level and the node's labels either flat (``region = "eu"``) or in a ``[labels]`` table.
Every key also reads from ``WEIGHTSHIP_AGENT_<KEY>`` (``WEIGHTSHIP_AGENT_DATA_DIR``,
``WEIGHTSHIP_AGENT_TOKEN``...) and from ``--<key>`` on the command line (``--data-dir``).
Sizes accept binary and decimal suffixes (``20GiB``, ``500M``); durations are seconds.
The token is an *enrolment token* (an ``agent`` token an admin minted for provisioning): the
agent uses it once, to enrol, and from then on its own node token, kept in
``<data_dir>/state/node-token.json`` (``agent.identity``). It can come from ``token_file`` so it
never shows in a process listing. Without a
file setting or ``WEIGHTSHIP_AGENT_*`` variable, the CLI's ``WEIGHTSHIP_URL`` and
``WEIGHTSHIP_TOKEN`` are used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from agent.hookcalls import DEFAULT_TIMEOUT, SwitchHook, parse_hook, parse_hook_flag
from weightship.errors import ValidationError
from weightship.manifest import check_model_name
from weightship.schemas import NodeLabels
from weightship.sizes import parse_size

__all__ = ["ENV_PREFIX", "AgentConfig", "build_parser", "check_disk", "load_config"]

ENV_PREFIX = "WEIGHTSHIP_AGENT_"
LABEL_KEYS = ("region", "cluster", "zone", "rack", "gpu_type")


def _default_name() -> str:
    name = re.sub(r"[^a-z0-9._-]", "-", socket.gethostname().lower()).strip("-.") or "node"
    return name[:128]


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent is configured with."""

    #: base URL of the control plane, e.g. ``http://controlplane:8080``
    control_plane: str
    #: enrolment token (``agent`` role, bound to no node): used to enrol when the node has no node token yet
    token: str = ""
    #: node name; the same name re-registers the same node
    name: str = field(default_factory=_default_name)
    #: where versions, staging areas and state live
    data_dir: Path = Path("/var/lib/weightship")
    #: most bytes the versions and staging areas may use; 0 = only the disk's free space bounds it
    quota_bytes: int = 0
    #: bytes the agent always leaves free on the file system
    min_free_bytes: int = 0
    labels: NodeLabels = field(default_factory=NodeLabels)
    #: deployments this node serves
    deployments: tuple[str, ...] = ()
    #: ``host:port`` (port 0 picks a free one) or ``unix:/path/to.sock``
    local_api: str = "127.0.0.1:7070"
    #: chunk requests in flight per version
    concurrency: int = 8
    #: most bytes of chunk buffers held in memory at once
    memory_bytes: int = 512 * 1024 * 1024
    #: tries per chunk before the version's fetch fails (a later reconcile tries again)
    chunk_attempts: int = 5
    heartbeat_interval: float = 5.0
    #: seconds one desired-state long-poll may wait at the control plane
    poll_wait: float = 25.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    #: seconds between a version becoming ready and its flush to disk (``agent.durability``); a crash before
    #: the flush costs a re-hash of that version at start-up
    sync_delay: float = 0.0
    #: also stage the other versions a deployment keeps (previous stable, canary) once idle
    prefetch: bool = True
    log_level: str = "info"
    #: ``node`` (a GPU node) or ``cache`` (a read-through chunk cache for a cluster or region)
    role: str = "node"
    #: a cache's tier: ``cluster`` (nodes' first stop) or ``region`` (caches' upstream)
    tier: str = "cluster"
    #: a cache's upstream: the next tier's peer URL; empty means the origin (via the control plane)
    upstream: str = ""
    #: ``host:port`` of the peer listener (``/v1/chunks``); empty: off on a node, ``0.0.0.0:7071`` on a cache
    peer_listen: str = ""
    #: ``host:port`` of a listener serving only ``/metrics`` (empty: off; the local API serves it too)
    metrics_listen: str = ""
    #: the URL others reach the peer listener at (default: derived from ``peer_listen``)
    peer_address: str = ""
    #: uploads served at once before requesters get 503 + Retry-After
    upload_concurrency: int = 16
    #: upload bytes per second, all uploads together (0: unlimited)
    upload_bandwidth: int = 0
    #: a cache's fetches from its upstream in flight at once
    upstream_concurrency: int = 8
    #: (cache) streams reading a version ahead after its first request (0: off)
    read_ahead: int = 2
    #: a cache's upstream bytes per second (0: unlimited)
    upstream_bandwidth: int = 0
    #: a cache's chunk store size; least recently used chunks of versions no pointer names go first (0: no bound)
    cache_bytes: int = 0
    #: the cluster's tracker (the cluster cache's peer URL); default: ``cluster_cache``
    tracker: str = ""
    #: the cluster cache's peer URL: a node's next source after peers (empty: none)
    cluster_cache: str = ""
    #: the region cache's peer URL: a node's next source after the cluster cache (empty: none)
    region_cache: str = ""
    #: bytes/s below which a peer is cut off and reported slow (after a 2 s allowance)
    peer_min_rate: int = 5_000_000
    #: chunks in flight per version while a tracker serves this node (at most ``concurrency``): about the
    #: tracker's fan-out, so a node pulls from about as many parents as a parent serves children
    peer_concurrency: int = 4
    #: seconds between a node's full re-announcements to the tracker (soft state)
    announce_interval: float = 10.0
    #: (cluster cache) most children the tracker sends to one parent at once
    tracker_fanout: int = 4
    #: (cluster cache) most chunk fetches from the caches the tracker grants at once
    tracker_upstream_slots: int = 8
    #: (cluster cache) the cluster's networks (comma-separated CIDRs): announced peer addresses must
    #: be IPs inside them; empty: any address but link-local and metadata (``agent.tracker_limits``)
    tracker_networks: str = ""
    #: per deployment, how to tell an external model server that its ``current`` link moved
    #: (``agent.switchhooks``; file: a ``[switch_hooks.<deployment>]`` table; flag: ``--switch-hook``)
    switch_hooks: tuple[SwitchHook, ...] = ()
    #: signing policy file (``weightship.signing_policy``; a mounted ConfigMap or Secret): versions it refuses
    #: are never fetched here. Empty: no policy (every version the control plane names is fetched)
    signing_policy: str = ""

    def __post_init__(self) -> None:
        if not self.control_plane.startswith(("http://", "https://")):
            raise ValidationError(
                f"control_plane {self.control_plane!r} must be an http:// or https:// URL (set --control-plane)"
            )
        check_model_name(self.name)
        for deployment in self.deployments:
            check_model_name(deployment)
        for key in ("quota_bytes", "min_free_bytes"):
            if getattr(self, key) < 0:
                raise ValidationError(f"{key} must not be negative")
        if min(self.concurrency, self.chunk_attempts, self.peer_concurrency) < 1:
            raise ValidationError("concurrency, peer_concurrency and chunk_attempts must be at least 1")
        if self.heartbeat_interval <= 0 or self.poll_wait <= 0 or self.backoff_initial <= 0:
            raise ValidationError("heartbeat_interval, poll_wait and backoff_initial must be positive")
        if self.sync_delay < 0:
            raise ValidationError("sync_delay must be zero or more seconds")
        if self.backoff_max < self.backoff_initial:
            raise ValidationError("backoff_max must be at least backoff_initial")
        if self.role not in ("node", "cache") or self.tier not in ("cluster", "region"):
            raise ValidationError(f"role must be node or cache and tier cluster or region; got {self.role}/{self.tier}")
        if self.upstream and not self.upstream.startswith(("http://", "https://")):
            raise ValidationError(f"upstream {self.upstream!r} must be the http(s) URL of the next tier's cache")
        for key in ("tracker", "cluster_cache", "region_cache"):
            if getattr(self, key) and not getattr(self, key).startswith(("http://", "https://")):
                raise ValidationError(f"{key} {getattr(self, key)!r} must be an http(s) URL of a cache's peer listener")
        if self.announce_interval <= 0:
            raise ValidationError("announce_interval must be positive")
        if self.tracker_fanout < 1 or self.tracker_upstream_slots < 1:
            raise ValidationError("tracker_fanout and tracker_upstream_slots must be at least 1")
        if self.read_ahead < 0:
            raise ValidationError("read_ahead must not be negative (0 turns the cache's read-ahead off)")
        if self.upload_concurrency < 1 or self.upstream_concurrency < 1:
            raise ValidationError("upload_concurrency and upstream_concurrency must be at least 1")
        for key in ("upload_bandwidth", "upstream_bandwidth", "cache_bytes"):
            if getattr(self, key) < 0:
                raise ValidationError(f"{key} must not be negative")
        hooked = [h.deployment for h in self.switch_hooks]
        if len(set(hooked)) != len(hooked):
            raise ValidationError("switch_hooks: one hook per deployment; a deployment is named twice")
        for name in hooked:
            if name not in self.deployments:
                raise ValidationError(
                    f"switch hook for deployment {name!r}, which this node does not serve; "
                    f"add --deployment {name} or remove the hook"
                )

    @property
    def peer_listener(self) -> str:
        """Where the peer listener binds, or ``""`` when it is off."""
        return self.peer_listen or ("0.0.0.0:7071" if self.role == "cache" else "")


_SIZE_KEYS = {"quota_bytes", "min_free_bytes", "memory_bytes", "upload_bandwidth", "upstream_bandwidth", "cache_bytes"}
_SIZE_KEYS |= {"peer_min_rate"}
_INT_KEYS = {"concurrency", "chunk_attempts", "upload_concurrency", "upstream_concurrency", "peer_concurrency"}
_INT_KEYS |= {"tracker_fanout", "tracker_upstream_slots", "read_ahead"}
_FLOAT_KEYS = {"heartbeat_interval", "poll_wait", "backoff_initial", "backoff_max", "announce_interval"}
_FLOAT_KEYS |= {"sync_delay"}
_ALIASES = {"quota": "quota_bytes", "memory": "memory_bytes", "min_free": "min_free_bytes"}


def build_parser() -> argparse.ArgumentParser:
    """The ``weightship-agent`` command line; every flag overrides file and environment."""
    parser = argparse.ArgumentParser(
        prog="weightship-agent",
        description="weightship node agent: fetches, verifies and serves model versions on this host.",
    )
    parser.add_argument("--config", help="TOML or JSON file (env WEIGHTSHIP_AGENT_CONFIG)")
    parser.add_argument("--control-plane", "--url", dest="control_plane", help="control-plane base URL")
    parser.add_argument("--token", help="enrolment token (prefer --token-file or WEIGHTSHIP_AGENT_TOKEN)")
    parser.add_argument("--token-file", help="file holding the enrolment token")
    parser.add_argument("--name", help="node name (default: host name)")
    parser.add_argument("--data-dir", help="directory for versions, staging and state")
    parser.add_argument("--quota", dest="quota_bytes", help="disk quota, e.g. 200GiB (0: none)")
    parser.add_argument("--min-free", dest="min_free_bytes", help="bytes always left free on the disk")
    for key in LABEL_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, help=f"node label {key}")
    parser.add_argument(
        "--deployment", dest="deployments", action="append", help="a deployment this node serves (repeatable)"
    )
    parser.add_argument(
        "--deployments", dest="deployment_list", help="comma-separated deployments (adds to --deployment)"
    )
    parser.add_argument("--local-api", help="host:port or unix:/path for the model-server API")
    parser.add_argument("--concurrency", help="chunk requests in flight per version")
    parser.add_argument("--memory", dest="memory_bytes", help="most bytes of chunk buffers in memory")
    parser.add_argument("--chunk-attempts", help="tries per chunk before a fetch fails")
    parser.add_argument("--heartbeat-interval", help="seconds between heartbeats")
    parser.add_argument("--sync-delay", help="seconds from a version being ready to its flush to disk (default 0)")
    parser.add_argument("--poll-wait", help="seconds a desired-state long-poll waits")
    parser.add_argument("--backoff-initial", help="first retry delay in seconds")
    parser.add_argument("--backoff-max", help="longest retry delay in seconds")
    parser.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also stage the previous stable and canary versions once idle (default: on)",
    )
    parser.add_argument("--signing-policy", help="signing policy file: versions it refuses are never fetched")
    parser.add_argument("--log-level", help="debug, info, warning or error")
    parser.add_argument("--role", choices=("node", "cache"), help="node (default) or cache")
    parser.add_argument("--tier", choices=("cluster", "region"), help="a cache's tier (default: cluster)")
    parser.add_argument("--upstream", help="a cache's upstream: the next tier's peer URL (default: the origin)")
    parser.add_argument("--peer-listen", help="host:port of the peer listener (default: off; a cache 0.0.0.0:7071)")
    parser.add_argument("--peer-address", help="URL others reach the peer listener at")
    parser.add_argument(
        "--metrics-listen", help="host:port serving only GET /metrics for Prometheus (default: off)"
    )
    parser.add_argument("--upload-concurrency", help="uploads served at once (default 16)")
    parser.add_argument("--upload-bandwidth", help="upload bytes per second, e.g. 100MB (0: unlimited)")
    parser.add_argument("--upstream-concurrency", help="a cache's upstream fetches at once (default 8)")
    parser.add_argument("--read-ahead", help="(cache) streams reading a version ahead at once (default 2; 0: off)")
    parser.add_argument("--upstream-bandwidth", help="a cache's upstream bytes per second (0: unlimited)")
    parser.add_argument("--cache-bytes", help="a cache's chunk store size, e.g. 500GiB (0: no bound)")
    parser.add_argument("--tracker", help="the cluster tracker's URL (default: --cluster-cache)")
    parser.add_argument("--cluster-cache", help="the cluster cache's peer URL (a node's source after peers)")
    parser.add_argument("--region-cache", help="the region cache's peer URL (after the cluster cache)")
    parser.add_argument("--peer-min-rate", help="bytes/s below which a peer is reported slow (default 5MB)")
    parser.add_argument(
        "--peer-concurrency", help="chunks in flight per version with a tracker (default 4, at most --concurrency)"
    )
    parser.add_argument("--announce-interval", help="seconds between full re-announcements (default 10)")
    parser.add_argument("--tracker-fanout", help="(cluster cache) children per parent at once (default 4)")
    parser.add_argument(
        "--tracker-upstream-slots", help="(cluster cache) chunk fetches from the caches at once (default 8)"
    )
    parser.add_argument(
        "--tracker-networks", help="(cluster cache) CIDRs announced peer addresses must lie in, comma-separated"
    )
    parser.add_argument(
        "--switch-hook",
        dest="switch_hooks",
        action="append",
        help="after DEPLOYMENT's version switches: DEPLOYMENT=command:PROGRAM ARGS, "
        "DEPLOYMENT=signal:[SIGNAL:]PIDFILE or DEPLOYMENT=http://HOST:PORT/PATH (repeatable)",
    )
    parser.add_argument(
        "--switch-hook-timeout", help="seconds a --switch-hook call may take (default 120)"
    )
    return parser


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValidationError(f"cannot read agent config {path}: {exc.strerror}") from None
    try:
        doc = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError(
            f"agent config {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}"
        ) from None
    if not isinstance(doc, dict):
        raise ValidationError(f"agent config {path} must hold a table/object of settings")
    flat = dict(doc)
    labels = flat.pop("labels", {})
    if not isinstance(labels, dict):
        raise ValidationError(f"agent config {path}: labels must be a table of strings")
    flat.update(labels)
    return flat


def _from_env(environ: Mapping[str, str], known: set[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in known:
        value = environ.get(ENV_PREFIX + key.upper())
        if value is not None:
            if key == "deployments":
                found[key] = [d for d in re.split(r"[,\s]+", value) if d]
            elif key == "switch_hooks":  # one DEPLOYMENT=... per line, as --switch-hook takes them
                found[key] = [line.strip() for line in value.splitlines() if line.strip()]
            else:
                found[key] = value
    return found


def _coerce(key: str, value: Any) -> Any:
    try:
        if key in _SIZE_KEYS:
            return parse_size(value)
        if key in _INT_KEYS:
            return int(value)
        if key in _FLOAT_KEYS:
            return float(value)
    except (TypeError, ValueError):
        raise ValidationError(f"{key}={value!r} is not a number") from None
    if key == "prefetch" and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if key == "deployments":
        return tuple(value)
    if key == "switch_hooks":
        return _hooks(value)
    if key == "data_dir":
        return Path(value)
    return value


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """The configuration from flags, the environment and the config file."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    listed = [d for d in re.split(r"[,\s]+", args.pop("deployment_list") or "") if d]
    if listed:
        args["deployments"] = [*(args["deployments"] or []), *listed]
    known = {f.name for f in fields(AgentConfig)} - {"labels"} | set(LABEL_KEYS) | {"token_file", "switch_hook_timeout"}
    merged: dict[str, Any] = {}
    config_path = args.pop("config") or environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        for key, value in _read_file(Path(config_path)).items():
            key = _ALIASES.get(key, key)
            if key not in known:
                raise ValidationError(f"agent config {config_path}: unknown setting {key!r}")
            merged[key] = value
    # The CLI's variables, as a fallback on a workstation that already exports them.
    for key, name in (("control_plane", "WEIGHTSHIP_URL"), ("token", "WEIGHTSHIP_TOKEN")):
        if key not in merged and environ.get(name):
            merged[key] = environ[name]
    merged.update(_from_env(environ, known))
    merged.update({k: v for k, v in args.items() if v is not None})
    token_file = merged.pop("token_file", None)
    if token_file and not merged.get("token"):
        try:
            merged["token"] = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValidationError(f"cannot read token file {token_file}: {exc.strerror}") from None
    hook_timeout = merged.pop("switch_hook_timeout", None)
    if hook_timeout is not None and "switch_hooks" in merged:
        merged["switch_hooks"] = _with_timeout(_hooks(merged["switch_hooks"]), hook_timeout)
    labels = NodeLabels(**{k: str(merged.pop(k)) for k in LABEL_KEYS if k in merged})
    if "control_plane" not in merged:
        raise ValidationError(
            "no control plane configured: pass --control-plane URL or set WEIGHTSHIP_AGENT_CONTROL_PLANE"
        )
    values = {k: _coerce(k, v) for k, v in merged.items()}
    return AgentConfig(labels=labels, **values)


def _hooks(value: Any) -> tuple[SwitchHook, ...]:
    """Hooks from a file table (``{deployment: {command|signal+pidfile|http, timeout}}``) or flag strings."""
    if isinstance(value, tuple) and all(isinstance(h, SwitchHook) for h in value):
        return value
    if isinstance(value, dict):
        return tuple(parse_hook(str(name), spec) for name, spec in value.items())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(parse_hook_flag(v) for v in value)
    raise ValidationError("switch_hooks must be a table of deployment = hook settings, or DEPLOYMENT=... strings")


def _with_timeout(hooks: tuple[SwitchHook, ...], timeout: Any) -> tuple[SwitchHook, ...]:
    """``--switch-hook-timeout`` applied to every hook that does not set its own in the config file."""
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise ValidationError(f"switch_hook_timeout={timeout!r} is not a number of seconds") from None
    return tuple(replace(h, timeout=seconds) if h.timeout == DEFAULT_TIMEOUT else h for h in hooks)


def check_disk(config: AgentConfig) -> None:
    """Refuse a quota the disk under ``data_dir`` cannot hold (a ``ValidationError`` saying what to change).

    Checked once at start-up against the filesystem's size (``os.statvfs``), so a chart default or
    a typo (``800GiB`` on a 100 GiB root volume) fails at once instead of filling the node's disk.
    """
    if config.quota_bytes <= 0:
        return
    where = config.data_dir.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent  # the directory may not exist yet: its filesystem is its nearest ancestor's
    stat = os.statvfs(where)
    size = stat.f_blocks * stat.f_frsize
    wanted = config.quota_bytes + config.min_free_bytes
    if wanted > size:
        gib = 1024**3
        raise ValidationError(
            f"disk quota {config.quota_bytes / gib:.1f} GiB (plus min_free {config.min_free_bytes / gib:.1f} GiB) "
            f"is larger than the filesystem holding data_dir {config.data_dir} ({size / gib:.1f} GiB in all): "
            "lower --quota (WEIGHTSHIP_AGENT_QUOTA_BYTES, Helm value agent.quota) or put data_dir on a larger "
            "disk (instance-store NVMe or a PersistentVolume, docs/kubernetes.md#data-directory)"
        )
