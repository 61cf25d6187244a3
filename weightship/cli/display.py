"""How the CLI shows things to people: rich tables and panels built from the API schemas.

Scripts get JSON instead (``--json``); nothing here is parsed by programs, so it may change
shape freely. Digests are shortened to their first 12 hex characters where a table would
otherwise overflow, and shown whole where a person copies them (``versions``, one deployment).
A whole digest is never wrapped: its cells are ``no_wrap`` (other cells wrap instead), and off a
terminal ``console()`` draws rows as wide as their content, since there is no screen to fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from rich.console import Console, Group, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from weightship.manifest import Manifest
from weightship.publishing import PublishResult
from weightship.schemas import (
    Deployment,
    DeploymentStatus,
    FetchFailure,
    FetchProblem,
    ModelInfo,
    NodeInfo,
    PointerEvent,
    Preheat,
    TokenCreated,
    TokenInfo,
    VersionInfo,
    VersionInventory,
    VersionState,
)
from weightship.sizes import format_size

__all__ = [
    "MeanSpeedColumn",
    "RichPublishProgress",
    "console",
    "deployment_table",
    "deployments_table",
    "describe_problem",
    "history_table",
    "manifest_table",
    "models_table",
    "nodes_table",
    "preheats_table",
    "publish_summary",
    "selector_text",
    "short_digest",
    "status_view",
    "token_created",
    "tokens_table",
    "version_table",
    "versions_table",
]


#: Width of a console that writes to a pipe or file: rows as wide as their content.
_UNBOUNDED_WIDTH = 10_000


def console(*, stderr: bool = False) -> Console:
    """The console the CLI prints with: the terminal's width, or unbounded off a terminal."""
    out = Console(stderr=stderr, highlight=False)
    if not out.is_terminal:
        out = Console(stderr=stderr, highlight=False, width=_UNBOUNDED_WIDTH)
    return out


def short_digest(digest: str | None) -> str:
    """The first 12 hex characters of a ``sha256:`` digest (as ``docker`` shows ids), or ``-``."""
    return digest.removeprefix("sha256:")[:12] if digest else "-"


def _t(text: str) -> Text:
    """Text as it is: names, reasons and labels come from users and must never be read as markup."""
    return Text(text)


def _utc(at: datetime) -> datetime:
    """``at`` in UTC; a time without a zone is UTC (all API times are), never local time."""
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _when(at: datetime | None) -> str:
    return _utc(at).strftime("%Y-%m-%d %H:%M:%SZ") if at else "-"


def _ago(at: datetime | None, now: datetime) -> str:
    if at is None:
        return "never"
    seconds = max(0.0, (_utc(now) - _utc(at)).total_seconds())
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def models_table(models: Sequence[ModelInfo]) -> Table:
    """``weightship models``."""
    table = Table("MODEL", "VERSIONS", "PICKLE", "CREATED", title="models", title_justify="left")
    for m in models:
        table.add_row(m.name, str(m.versions), "allowed" if m.allow_pickle else "refused", _when(m.created_at))
    return table


def versions_table(model: str, versions: Sequence[VersionInfo]) -> Table:
    """``weightship versions M``: newest last, full digests."""
    table = Table(
        "LABELS", "DIGEST", "SIZE", "FILES", "CREATED", "BY", title=f"versions of {model}", title_justify="left"
    )
    table.columns[1].no_wrap = True
    for v in sorted(versions, key=lambda v: v.created_at):
        table.add_row(
            ", ".join(v.labels) or "-",
            v.digest,
            format_size(v.size),
            str(v.files),
            _when(v.created_at),
            _t(v.created_by),
        )
    return table


def version_table(version: VersionInfo) -> Table:
    """The facts of one version, as a two-column table."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(no_wrap=True)
    for key, value in (
        ("model", version.model),
        ("digest", version.digest),
        ("labels", ", ".join(version.labels) or "-"),
        ("state", version.state),
        ("size", f"{format_size(version.size)} ({version.size} bytes)"),
        ("files", str(version.files)),
        ("created", f"{_when(version.created_at)} by {version.created_by}"),
    ):
        table.add_row(key, _t(value))
    return table


def manifest_table(manifest: Manifest) -> Table:
    """The files of a version with their sizes, chunks and tensor counts."""
    table = Table(
        "PATH",
        "SIZE",
        "TYPE",
        "CHUNKS",
        "TENSORS",
        "SHA256",
        title=f"files (chunk size {format_size(manifest.chunk_size)})",
        title_justify="left",
    )
    for f in manifest.files:
        tensors = str(len(f.safetensors.tensors)) if f.safetensors else "-"
        table.add_row(_t(f.path), format_size(f.size), _t(f.media_type), str(len(f.chunks)), tensors, f.sha256[:12])
    return table


def deployment_table(deployment: Deployment) -> Table:
    """A deployment's serving pointer."""
    table = Table(
        show_header=False, box=None, pad_edge=False, title=f"deployment {deployment.name}", title_justify="left"
    )
    table.add_column(style="bold")
    table.add_column(no_wrap=True)
    canary = f"{deployment.canary} ({deployment.canary_share:.0%})" if deployment.canary else "-"
    for key, value in (
        ("model", deployment.model),
        ("stable", deployment.stable or "-"),
        ("previous", deployment.previous_stable or "-"),
        ("canary", canary),
        ("epoch", str(deployment.epoch)),
        ("updated", _when(deployment.updated_at)),
        ("warm pool", selector_text(deployment.warm_pool.selector) if deployment.warm_pool else "-"),
    ):
        table.add_row(key, value)
    return table


def selector_text(selector: Mapping[str, str]) -> str:
    """A node selector as ``k=v,...`` (``*``: every node)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or "*"


def preheats_table(deployment: str, preheats: Sequence[Preheat]) -> Table:
    """``weightship preheat D --list``: each standing preheat and how far its nodes have got."""
    table = Table(
        "ID", "VERSION", "DIGEST", "SELECTOR", "MATCHED", "STAGED", "FETCHING", "FAILED", "BY",
        title=f"preheats of {deployment}", title_justify="left",
    )  # fmt: skip
    for p in preheats:
        table.add_row(
            p.id,
            p.version,
            short_digest(p.digest),
            selector_text(p.selector),
            str(p.nodes_matched),
            str(p.nodes_staged),
            str(p.nodes_fetching),
            str(p.nodes_failed),
            p.created_by,
        )
    return table


def history_table(name: str, events: Sequence[PointerEvent]) -> Table:
    """``weightship history D``: one row per epoch, newest first."""
    table = Table(
        "EPOCH", "AT", "ACTION", "BY", "STABLE", "CANARY", "REASON", title=f"history of {name}", title_justify="left"
    )
    for e in sorted(events, key=lambda e: e.epoch, reverse=True):
        stable = f"{short_digest(e.from_stable)} → {short_digest(e.to_stable)}"
        canary = f"{short_digest(e.to_canary)} {e.canary_share:.0%}" if e.to_canary else "-"
        table.add_row(str(e.epoch), _when(e.at), e.action, _t(e.actor), stable, canary, _t(e.reason))
    return table


def deployments_table(deployments: Sequence[Deployment]) -> Table:
    """``weightship deploy list``."""
    table = Table(
        "DEPLOYMENT",
        "MODEL",
        "STABLE",
        "PREVIOUS",
        "CANARY",
        "EPOCH",
        "UPDATED",
        title="deployments",
        title_justify="left",
    )
    for d in deployments:
        canary = f"{short_digest(d.canary)} {d.canary_share:.0%}" if d.canary else "-"
        table.add_row(
            d.name,
            d.model,
            short_digest(d.stable),
            short_digest(d.previous_stable),
            canary,
            str(d.epoch),
            _when(d.updated_at),
        )
    return table


def nodes_table(nodes: Sequence[NodeInfo], now: datetime | None = None) -> Table:
    """``weightship nodes``."""
    now = now or datetime.now(UTC)
    table = Table(
        "NODE", "ROLE", "PLACE", "GPU", "SEEN", "SERVING", "VERSIONS", "DOWNLOADED", "PROBLEMS",
        title="nodes",
        title_justify="left",
    )
    for n in sorted(nodes, key=lambda n: n.name):
        place = "/".join((n.labels.region, n.labels.cluster, n.labels.zone, n.labels.rack))
        seen = Text(_ago(n.last_seen, now), style="red" if n.stale else "")
        if n.stale:
            seen.append(" stale", style="bold red")
        serving = ", ".join(f"{s.name}={short_digest(s.digest)}@{s.epoch}" for s in n.serving) or "-"
        counts: dict[str, int] = {}
        for v in n.inventory:
            counts[_state_word(v)] = counts.get(_state_word(v), 0) + 1
        order = ("ready", "fetching", "retrying", "failed")
        versions = " ".join(f"{counts[s]} {s}" for s in order if s in counts) or "-"
        if counts.get("failed") or counts.get("retrying"):
            versions = f"[red]{versions}[/red]"
        table.add_row(
            n.name,
            n.role,
            _t(place),
            _t(n.labels.gpu_type),
            seen,
            serving,
            versions,
            format_size(n.counters.bytes_downloaded),
            _problems(n, now),
        )
    return table


def _state_word(item: VersionInventory) -> str:
    """``retrying`` for a fetch that keeps failing, else the version's state."""
    if item.state == VersionState.fetching and item.problem is not None:
        return "retrying"
    return item.state.value


def describe_problem(problem: FetchProblem, state: VersionState, now: datetime, *, full: bool = False) -> str:
    """One line: what keeps failing (for a corrupt origin, which blob and chunk), since when, what next.

    ``full`` shows whole digests (where a person copies them); otherwise 12 hex characters.
    """

    def digest(hex_value: str | None) -> str:
        return (hex_value or "?") if full else short_digest(hex_value)

    if problem.reason == FetchFailure.corrupt_origin:
        what = (
            f"corrupt origin blob {digest(problem.blob)} chunk {problem.chunk_index} "
            f"({problem.file}, expected sha256:{digest(problem.chunk_digest)}): "
            f"rejected {problem.chunk_attempts} times"
        )
    else:
        what = f"{problem.reason.value.replace('_', ' ')}: {problem.message}"
    tries = f"{problem.attempts} failed attempt{'' if problem.attempts == 1 else 's'}"
    since = f"since {_when(problem.since)} ({_ago(problem.since, now)}, {tries})"
    if state == VersionState.fetching:
        return f"retrying {since}; {what}"
    after = f"retries at {_when(problem.retry_at)}" if problem.retry_at else "retries on the next desired state"
    fix = {
        FetchFailure.corrupt_origin: "restore or re-publish the blob, then ",
        FetchFailure.signature_refused: "add a signature the node's policy trusts ('weightship sign'), then ",
    }.get(problem.reason, "")
    return f"failed {since}; {what}; {after}, or {fix}re-point the deployment to retry now"


def _problems(node: NodeInfo, now: datetime) -> Text:
    """Failed or retrying versions, health errors and refused pointers, one per line; '-' when none."""
    lines = [
        f"{short_digest(v.digest)}: {describe_problem(v.problem, v.state, now)}"
        if v.problem
        else f"{short_digest(v.digest)}: {v.error}"
        for v in node.inventory
        if v.problem or v.error
    ]
    reported = {v.error for v in node.inventory if v.problem}
    lines += [e for e in node.health.errors if e not in reported]
    lines += [f"refused: {r}" for r in node.refused]
    return Text("\n".join(lines), style="red") if lines else Text("-")


def status_view(status: DeploymentStatus, now: datetime | None = None) -> RenderableType:
    """``weightship status D``: the pointer, per version how far the fleet is, then what keeps failing where."""
    now = now or datetime.now(UTC)
    d = status.deployment
    versions = Table(
        "ROLE",
        "DIGEST",
        "DESIRED",
        "READY",
        "FETCHING",
        "RETRYING",
        "FAILED",
        "SERVING",
        "LAG",
        "BYTES",
        title="versions across the fleet",
        title_justify="left",
    )
    for v in status.versions:
        lag = max(0, v.nodes_desired - v.nodes_serving)
        percent = f" ({v.bytes_present / v.bytes_total:.0%})" if v.bytes_total else ""
        versions.add_row(
            v.role,
            short_digest(v.digest),
            str(v.nodes_desired),
            str(v.nodes_ready),
            str(v.nodes_fetching - v.nodes_retrying),
            f"[red]{v.nodes_retrying}[/red]" if v.nodes_retrying else "0",
            f"[red]{v.nodes_failed}[/red]" if v.nodes_failed else "0",
            str(v.nodes_serving),
            f"[yellow]{lag}[/yellow]" if lag else "0",
            f"{format_size(v.bytes_present)} / {format_size(v.bytes_total)}{percent}",
        )
    summary = Text(f"{status.nodes} nodes, {status.stale_nodes} stale")
    if status.lagging_nodes:
        summary.append(f"; not yet serving what they should: {', '.join(status.lagging_nodes)}", style="yellow")
    else:
        summary.append("; every node serves what it should", style="green")
    if status.delivered_bytes:
        summary.append(
            f"\norigin egress {format_size(status.origin_bytes)} for {format_size(status.delivered_bytes)} "
            f"delivered to nodes ({status.origin_bytes / status.delivered_bytes:.0%} from the origin)"
        )
    problems = [
        Text(f"{p.node} {v.role} {short_digest(v.digest)}: {describe_problem(p.problem, p.state, now, full=True)}")
        for v in status.versions
        for p in v.problems
    ]
    if problems:
        problems.insert(0, Text("fetches that keep failing:", style="bold red"))
    if status.hook_failures:
        problems.append(Text("switch hooks that keep failing (the model server did not get the switch):", style="bold red"))
        problems += [Text(line, style="red") for line in status.hook_failures]
    return Group(deployment_table(d), Text(""), versions, summary, *problems)


def tokens_table(tokens: Sequence[TokenInfo]) -> Table:
    """``weightship token list``."""
    table = Table("ID", "NAME", "ROLE", "NODE", "CREATED", "BY", title="tokens", title_justify="left")
    for t in tokens:
        # NODE: the node a node token acts for; "-" for every other token (agent: an enrolment token).
        node = _t(t.node_id) if t.node_id else "-"
        table.add_row(_t(t.id), _t(t.name), t.role.value, node, _when(t.created_at), _t(t.created_by))
    return table


def token_created(token: TokenCreated) -> RenderableType:
    """A new token, with the one-time secret and what to do with it."""
    return Group(
        Text.assemble(("token ", "bold"), (token.id, ""), (f" ({token.name}, role {token.role.value})", "dim")),
        Text(token.token, style="bold green"),
        Text("This secret is shown once; store it now (e.g. export WEIGHTSHIP_TOKEN=...).", style="yellow"),
    )


def publish_summary(result: PublishResult) -> RenderableType:
    """What a publish did, in particular how much it did not have to upload."""
    v = result.version
    head = Text.assemble(
        ("published ", "bold green"), (f"{v.model}@{','.join(v.labels) or '-'}", "bold"), f" {v.digest}"
    )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    rate = result.hash_bytes_per_second
    parts = f"{result.parts_uploaded} part{'' if result.parts_uploaded == 1 else 's'}"
    table.add_row("total", format_size(result.bytes_total), f"{result.files} files")
    table.add_row("uploaded", format_size(result.bytes_uploaded), f"{parts} in {result.upload_seconds:.2f}s")
    table.add_row("deduplicated", format_size(result.bytes_deduplicated), "already in the store, not sent")
    if result.bytes_resumed:
        table.add_row("resumed", format_size(result.bytes_resumed), "uploaded by an earlier, interrupted run")
    table.add_row("hashed", f"{result.hash_seconds:.2f}s", f"{format_size(rate)}/s")
    table.add_row("committed", f"{result.commit_seconds:.2f}s", "the control plane verified every blob")
    if not result.skipped:
        return Group(head, table)
    skipped = Text.assemble(
        ("skipped ", "bold yellow"),
        f"{len(result.skipped)} hidden name{'' if len(result.skipped) == 1 else 's'} (not part of a version): ",
        ", ".join(result.skipped),
    )
    return Group(head, table, skipped)


class MeanSpeedColumn(ProgressColumn):
    """Bytes per second since the bar started; the summary's figure once ``rate`` is set at the end.

    rich's ``TransferSpeedColumn`` shows a moving average over recent updates, which ends on
    another number than the summary's bytes over seconds; this one measures what the summary does.
    """

    def render(self, task: Task) -> Text:
        """``12.3 MiB/s``, or ``?`` before anything was measured."""
        rate = task.fields.get("rate")
        if rate is None:
            elapsed = task.elapsed
            rate = task.completed / elapsed if elapsed else None
        return Text(f"{format_size(rate)}/s" if rate is not None else "?", style="progress.data.speed")


class RichPublishProgress:
    """A ``PublishProgress`` drawing one bar for hashing and one for uploading."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._hash: TaskID | None = None
        self._upload: TaskID | None = None

    @staticmethod
    def columns() -> tuple[ProgressColumn, ...]:
        """The columns both bars use."""
        return (
            TextColumn("{task.description:<9}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            MeanSpeedColumn(),
            TimeRemainingColumn(),
        )

    def hashing(self, total_bytes: int) -> None:
        """Add the hashing bar."""
        self._hash = self.progress.add_task("hashing", total=total_bytes)

    def hashed(self, nbytes: int) -> None:
        """Advance the hashing bar."""
        if self._hash is not None:
            self.progress.advance(self._hash, nbytes)

    def hash_done(self, total_bytes: int, seconds: float) -> None:
        """Stop the hashing bar on the summary's figures: ``total_bytes`` over ``seconds``."""
        if self._hash is not None:
            rate = total_bytes / seconds if seconds > 0 else 0.0
            self.progress.update(self._hash, total=total_bytes, completed=total_bytes, rate=rate)
            self.progress.stop_task(self._hash)

    def uploading(self, total_bytes: int, done_bytes: int) -> None:
        """Add the upload bar."""
        self._upload = self.progress.add_task("uploading", total=total_bytes, completed=done_bytes)

    def uploaded(self, nbytes: int) -> None:
        """Advance the upload bar."""
        if self._upload is not None:
            self.progress.advance(self._upload, nbytes)
