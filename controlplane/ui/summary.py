"""What the status page shows, read in one pass from the same query functions the API's read routes use.

``read_summary`` is called by the page's broadcaster (``controlplane.ui.hub``) only when something
changed, never per page; every open page is then served from the one ``Summary`` it holds. It
reads, in a handful of statements whatever the fleet's size:

- every node (``controlplane.fleet.node_infos``, what ``GET /v1/nodes`` answers), tallied in one
  pass into per-version counts by region and cluster, problem nodes, bytes per chunk source and
  the model servers' counters per version;
- every deployment with its pointer (``to_schema``) and the newest entries of its audit history;
- the newest rollout of each deployment (``list_rollouts``, what ``rollout status`` shows);
- each deployment's preheats with their progress (``list_preheats``);
- the labels of the versions shown, so people see ``v7``, not only a digest.

The node list is kept compact (``NodeView``) so that 5,000 nodes cost a few hundred kilobytes in
memory and the page pages through them server-side.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select

from controlplane.deployments import event_schema, to_schema
from controlplane.fleet import node_infos
from controlplane.persistence.rows import DeploymentRow, LabelRow, PointerEventRow, utcnow
from controlplane.preheats import list_preheats, preheated_digests
from controlplane.rollout_resources import list_rollouts
from controlplane.state import AppState
from weightship.schemas import Deployment, NodeInfo, PointerEvent, Preheat, Rollout, VersionState

__all__ = [
    "CACHE_SOURCES",
    "HISTORY",
    "Counts",
    "DeploymentView",
    "NodeView",
    "Problem",
    "ServeTotals",
    "Summary",
    "read_summary",
]

#: pointer-history entries shown per deployment
HISTORY = 20
#: chunk sources that are caches (the rest: origin, peer, local)
CACHE_SOURCES = ("cluster_cache", "region_cache")


@dataclass
class Counts:
    """Nodes of one version in one place: holding it ready, fetching it, serving it."""

    ready: int = 0
    fetching: int = 0
    failed: int = 0
    serving: int = 0


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a node's fetch of a version is stuck: the reason, the blob and chunk at fault."""

    digest: str
    state: str
    reason: str
    message: str
    blob: str | None
    file: str | None
    chunk_index: int | None
    attempts: int


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the page lists it."""

    name: str
    role: str
    region: str
    cluster: str
    stale: bool
    last_seen: datetime | None
    deployments: tuple[str, ...]
    #: deployment -> the digest it serves there
    serving: tuple[tuple[str, str | None], ...]
    #: (digest, state, percent present)
    inventory: tuple[tuple[str, str, int], ...]
    problems: tuple[Problem, ...]


@dataclass
class ServeTotals:
    """The model servers' cumulative counters for one version of one deployment, summed over live nodes."""

    requests: int = 0
    errors: int = 0
    latency_sum: float = 0.0
    queue_depth: int = 0


@dataclass
class DeploymentView:
    """One deployment: pointer, history, versions across the fleet, its rollout and preheats."""

    deployment: Deployment
    history: list[PointerEvent]
    #: digest -> (region, cluster) -> counts, for stable, canary and previous stable
    versions: dict[str, dict[tuple[str, str], Counts]]
    rollout: Rollout | None
    preheats: list[Preheat]
    nodes: int = 0


@dataclass
class Summary:
    """Everything the page shows, as of ``at``."""

    at: datetime
    deployments: list[DeploymentView]
    nodes: list[NodeView]
    #: digest -> its labels
    labels: dict[str, list[str]]
    #: cumulative bytes delivered per kind of source: origin, cache, peer, local
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    #: (deployment, digest) -> serving counters
    serve: dict[tuple[str, str], ServeTotals] = field(default_factory=dict)

    @property
    def problem_nodes(self) -> list[NodeView]:
        """Nodes with a stuck fetch, or that stopped heartbeating."""
        return [n for n in self.nodes if n.problems or n.stale]


def _node_view(node: NodeInfo) -> NodeView:
    problems = tuple(
        Problem(
            digest=item.digest,
            state=item.state.value,
            reason=item.problem.reason.value,
            message=item.problem.message,
            blob=item.problem.blob,
            file=item.problem.file,
            chunk_index=item.problem.chunk_index,
            attempts=item.problem.attempts,
        )
        for item in node.inventory
        if item.problem is not None and item.state != VersionState.ready
    )
    inventory = tuple(
        (item.digest, item.state.value, 100 * item.bytes_present // item.bytes_total if item.bytes_total else 100)
        for item in node.inventory
    )
    return NodeView(
        name=node.name,
        role=node.role,
        region=node.labels.region,
        cluster=node.labels.cluster,
        stale=node.stale,
        last_seen=node.last_seen,
        deployments=tuple(node.deployments),
        serving=tuple((s.name, s.digest) for s in node.serving),
        inventory=inventory,
        problems=problems,
    )


def _tally(view: DeploymentView, node: NodeInfo) -> None:
    pointer = view.deployment
    digests = [d for d in (pointer.stable, pointer.canary, pointer.previous_stable) if d is not None]
    held = {item.digest: item.state for item in node.inventory}
    served = next((s.digest for s in node.serving if s.name == pointer.name), None)
    place = (node.labels.region, node.labels.cluster)
    view.nodes += 1
    for digest in dict.fromkeys(digests):
        counts = view.versions.setdefault(digest, {}).setdefault(place, Counts())
        state = held.get(digest)
        counts.ready += state == VersionState.ready
        counts.fetching += state == VersionState.fetching
        counts.failed += state == VersionState.failed
        counts.serving += served == digest


def read_summary(state: AppState) -> Summary:
    """Read everything the page shows (blocking: run it off the event loop)."""
    nodes = node_infos(state, None)
    with state.sessions() as session:
        preheated = preheated_digests(session)
        rows = session.scalars(select(DeploymentRow).order_by(DeploymentRow.name)).all()
        deployments = [to_schema(row, preheated.get(row.name, ())) for row in rows]
        histories = {
            d.name: [
                event_schema(e)
                for e in session.scalars(
                    select(PointerEventRow)
                    .where(PointerEventRow.deployment == d.name)
                    .order_by(PointerEventRow.epoch.desc())
                    .limit(HISTORY)
                )
            ]
            for d in deployments
        }
        models = {d.model for d in deployments}
        labels: dict[str, list[str]] = defaultdict(list)
        if models:
            for label in session.scalars(select(LabelRow).where(LabelRow.model.in_(models))):
                labels[label.digest].append(label.label)
    newest: dict[str, Rollout] = {}
    for rollout in list_rollouts(state, None, active=False, limit=max(100, 4 * len(deployments))):
        newest.setdefault(rollout.deployment, rollout)
    views = {
        d.name: DeploymentView(
            deployment=d,
            history=histories[d.name],
            versions={},
            rollout=newest.get(d.name),
            preheats=list_preheats(state, d.name),
        )
        for d in deployments
    }
    by_source: dict[str, int] = {"origin": 0, "cache": 0, "peer": 0, "local": 0}
    serve: dict[tuple[str, str], ServeTotals] = {}
    for node in nodes:
        if node.stale:
            continue
        sources = node.counters.sources
        origin = sources.get("origin")
        by_source["origin"] += origin.bytes if origin else 0
        if node.role != "node":
            continue  # a cache's own reads from the origin count; what it received is not delivered
        for name, tally in sources.items():
            kind = "cache" if name in CACHE_SOURCES else name if name in by_source else None
            if kind is not None and kind != "origin":
                by_source[kind] += tally.bytes
        for name in node.deployments:
            view = views.get(name)
            if view is not None:
                _tally(view, node)
        for version in node.serve.versions if node.serve is not None else ():
            totals = serve.setdefault((version.deployment, version.digest), ServeTotals())
            totals.requests += version.requests
            totals.errors += version.errors
            totals.latency_sum += version.latency_sum
            totals.queue_depth += version.queue_depth
    return Summary(
        at=utcnow(),
        deployments=list(views.values()),
        nodes=[_node_view(n) for n in nodes],
        labels={digest: sorted(names) for digest, names in labels.items()},
        bytes_by_source=by_source,
        serve=serve,
    )
