"""HTML of the status page, rendered on the server from a ``Summary``: plain templates, every value escaped.

``render_sections`` renders the parts that change (one HTML string per section id); the page
script swaps them in when the stream says the summary changed. ``render_nodes`` renders one page
of the node list. Sizes are bounded whatever the fleet: per-version breakdowns show at most
``MAX_PLACES`` places, problem nodes at most ``MAX_PROBLEMS``, the node list ``PAGE_SIZE`` a page.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from html import escape
from typing import Any

from controlplane.ui.summary import Counts, DeploymentView, NodeView, Summary
from weightship.schemas import Rollout

__all__ = ["MAX_PLACES", "MAX_PROBLEMS", "NODE_FILTERS", "PAGE_SIZE", "render_nodes", "render_sections"]

MAX_PLACES = 25
MAX_PROBLEMS = 50
PAGE_SIZE = 50
NODE_FILTERS = ("all", "problems", "stale")


def e(value: object) -> str:
    """``value`` as escaped HTML text."""
    return escape("" if value is None else str(value), quote=True)


def _short(digest: str | None) -> str:
    return "—" if digest is None else digest.removeprefix("sha256:")[:12]


def version_name(summary: Summary, digest: str | None) -> str:
    """A version as people call it: its labels, else the start of its digest."""
    if digest is None:
        return "—"
    labels = summary.labels.get(digest)
    return ",".join(labels) if labels else _short(digest)


def _version(summary: Summary, digest: str | None) -> str:
    if digest is None:
        return '<span class="none">—</span>'
    return f'<span class="version" title="{e(digest)}">{e(version_name(summary, digest))}</span>'


def _when(at: datetime | None) -> str:
    if at is None:
        return '<span class="none">never</span>'
    return f'<time class="age" datetime="{e(at.isoformat())}">{e(at.strftime("%H:%M:%S"))}</time>'


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    header = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>'


def _pointer(summary: Summary, view: DeploymentView) -> str:
    d = view.deployment
    canary = (
        f"{_version(summary, d.canary)} at <b class='share'>{d.canary_share * 100:.0f}%</b>"
        if d.canary
        else '<span class="none">none</span>'
    )
    return (
        f'<dl class="pointer" data-epoch="{d.epoch}">'
        f"<dt>stable</dt><dd class='stable'>{_version(summary, d.stable)}</dd>"
        f"<dt>canary</dt><dd class='canary'>{canary}</dd>"
        f"<dt>previous</dt><dd>{_version(summary, d.previous_stable)}</dd>"
        f"<dt>epoch</dt><dd class='epoch'>{d.epoch}</dd>"
        f"<dt>nodes</dt><dd>{view.nodes}</dd></dl>"
    )


def _role(view: DeploymentView, digest: str) -> str:
    d = view.deployment
    return "stable" if digest == d.stable else "canary" if digest == d.canary else "previous"


def _versions(summary: Summary, view: DeploymentView) -> str:
    if not view.versions:
        return '<p class="none">no version on any node yet</p>'
    parts = []
    for digest, places in view.versions.items():
        total = Counts()
        for c in places.values():
            total.ready += c.ready
            total.fetching += c.fetching
            total.failed += c.failed
            total.serving += c.serving
        rows = [
            [e(region), e(cluster), str(c.ready), str(c.fetching), str(c.failed), str(c.serving)]
            for (region, cluster), c in sorted(places.items())[:MAX_PLACES]
        ]
        more = len(places) - MAX_PLACES
        note = f'<p class="more">and {more} more clusters</p>' if more > 0 else ""
        parts.append(
            f'<div class="vers"><h4>{_role(view, digest)} {_version(summary, digest)}: '
            f"{total.ready} ready · {total.fetching} fetching · {total.failed} failed · {total.serving} serving</h4>"
            + _table(["region", "cluster", "ready", "fetching", "failed", "serving"], rows, "places")
            + note
            + "</div>"
        )
    return "".join(parts)


def _conditions(rollout: Rollout, step: int, metric: str) -> str:
    steps = rollout.spec.get("steps")
    try:
        analysis: dict[str, Any] = steps[step]["analysis"]  # type: ignore[index]
        spec = next(m for m in analysis.get("metrics", []) if m.get("name") == metric)
    except (TypeError, KeyError, IndexError, StopIteration):
        return ""
    found = [f"{kind} {spec[key]}" for kind, key in (("success", "successCondition"), ("failure", "failureCondition")) if key in spec]
    return "; ".join(found)


def _rollout(summary: Summary, rollout: Rollout | None) -> str:
    if rollout is None:
        return '<p class="none">no rollout</p>'
    state = "active" if not (rollout.completed or rollout.aborted) else "aborted" if rollout.aborted else "done"
    steps = "".join(
        f'<li class="step {e(s.state)}" data-index="{s.index}">{e(s.kind)}: {e(s.summary)}</li>' for s in rollout.steps
    )
    runs = []
    for run in rollout.analysis_runs:
        rows = []
        for metric in run.metrics:
            condition = _conditions(rollout, run.step_index, metric.name)
            for m in metric.measurements[-5:]:
                value = "no data" if m.value is None else m.value
                rows.append([e(metric.name), e(value), e(condition), f'<span class="phase {e(m.phase)}">{e(m.phase)}</span>', e(m.message)])
        runs.append(
            f'<div class="run"><h5>analysis of step {run.step_index + 1}: '
            f'<span class="phase {e(run.phase)}">{e(run.phase)}</span></h5>'
            + _table(["metric", "measured", "condition", "verdict", "message"], rows, "measurements")
            + "</div>"
        )
    if rollout.steps_total:
        step_text = f"step {min(rollout.step_index + 1, rollout.steps_total)} of {rollout.steps_total}"
    else:
        step_text = "no steps"
    return (
        f'<div class="rollout {state}" data-rollout="{e(rollout.id)}" data-step="{rollout.step_index}">'
        f'<h4>rollout of {_version(summary, rollout.version)} <span class="phase {e(rollout.phase)}">{e(rollout.phase)}</span> '
        f'<span class="stepno">{e(step_text)}</span> · weight <b class="weight">{rollout.weight:.0f}%</b></h4>'
        f'<p class="message">{e(rollout.message)}</p><ol class="steps">{steps}</ol>{"".join(runs)}</div>'
    )


def _preheats(view: DeploymentView) -> str:
    if not view.preheats:
        return ""
    rows = [
        [
            e(p.version),
            e(",".join(f"{k}={v}" for k, v in p.selector.items()) or "*"),
            f"{p.nodes_staged}/{p.nodes_matched}",
            str(p.nodes_fetching),
            str(p.nodes_failed),
            f'<progress max="{max(p.nodes_matched, 1)}" value="{p.nodes_staged}"></progress>',
        ]
        for p in view.preheats
    ]
    return "<h4>preheats</h4>" + _table(["version", "selector", "staged", "fetching", "failed", "progress"], rows)


def _history(summary: Summary, view: DeploymentView) -> str:
    items = "".join(
        f'<li class="event {e(ev.action)}"><span class="epoch">#{ev.epoch}</span> {_when(ev.at)} '
        f"<b>{e(ev.action)}</b> {_version(summary, ev.from_stable)} → {_version(summary, ev.to_stable)}"
        + (f" canary {_version(summary, ev.to_canary)} {ev.canary_share * 100:.0f}%" if ev.to_canary else "")
        + f' <span class="actor">by {e(ev.actor)}</span> <span class="reason">{e(ev.reason)}</span></li>'
        for ev in view.history
    )
    return f'<h4>history</h4><ol class="timeline">{items}</ol>'


def _deployment(summary: Summary, view: DeploymentView) -> str:
    name = view.deployment.name
    return (
        f'<section class="deployment" id="dep-{e(name)}" data-name="{e(name)}">'
        f"<h3>{e(name)} <small>model {e(view.deployment.model)}</small></h3>"
        f'<div class="cols"><div>{_pointer(summary, view)}{_rollout(summary, view.rollout)}{_preheats(view)}</div>'
        f"<div>{_versions(summary, view)}</div><div>{_history(summary, view)}</div></div></section>"
    )


def _problem_row(summary: Summary, node: NodeView) -> list[str]:
    if not node.problems:
        return [e(node.name), e(f"{node.region}/{node.cluster}"), "—", "stale: no heartbeat", "", "", _when(node.last_seen)]
    p = node.problems[0]
    where = e(p.file or (p.blob[:12] if p.blob else "—"))
    chunk = "—" if p.chunk_index is None else str(p.chunk_index)
    return [
        f'<b class="node">{e(node.name)}</b>',
        e(f"{node.region}/{node.cluster}"),
        _version(summary, p.digest),
        f'<span class="reason">{e(p.reason)}</span> ({e(p.state)}, {p.attempts} attempts)<br><small>{e(p.message[:300])}</small>',
        where,
        chunk,
        _when(node.last_seen),
    ]


def _problems(summary: Summary) -> str:
    problems = summary.problem_nodes
    if not problems:
        return '<p class="ok">no node has a problem</p>'
    rows = [_problem_row(summary, n) for n in problems[:MAX_PROBLEMS]]
    more = len(problems) - MAX_PROBLEMS
    note = f'<p class="more">and {more} more: see the node list, filter “problems”</p>' if more > 0 else ""
    head = ["node", "where", "version", "reason", "blob / file", "chunk", "last heartbeat"]
    return _table(head, rows, "problems") + note


def _overview(summary: Summary) -> str:
    live = [n for n in summary.nodes if not n.stale]
    caches = sum(n.role != "node" for n in live)
    b = summary.bytes_by_source
    delivered = b.get("cache", 0) + b.get("peer", 0) + b.get("origin", 0)
    mib = 2**20
    return (
        f'<ul class="overview"><li><b>{len(summary.deployments)}</b> deployments</li>'
        f"<li><b>{len(live) - caches}</b> live nodes, <b>{caches}</b> caches, "
        f"<b>{len(summary.nodes) - len(live)}</b> stale</li>"
        f"<li><b>{len(summary.problem_nodes)}</b> with problems</li>"
        f"<li>origin sent <b>{b.get('origin', 0) / mib:.1f} MiB</b>; caches <b>{b.get('cache', 0) / mib:.1f} MiB</b>, "
        f"peers <b>{b.get('peer', 0) / mib:.1f} MiB</b> (of {delivered / mib:.1f} MiB fetched)</li></ul>"
    )


def render_sections(summary: Summary) -> dict[str, str]:
    """Section id -> its HTML."""
    deployments = "".join(_deployment(summary, v) for v in summary.deployments) or '<p class="none">no deployment yet</p>'
    return {"overview": _overview(summary), "deployments": deployments, "problems": _problems(summary)}


def _matches(node: NodeView, kind: str, query: str) -> bool:
    if query and query not in node.name and query not in node.cluster and query not in node.region:
        return False
    return kind == "all" or (kind == "problems" and bool(node.problems)) or (kind == "stale" and node.stale)


def render_nodes(summary: Summary, page: int, kind: str, query: str) -> str:
    """One page (from 1) of the node list, filtered by ``kind`` (``NODE_FILTERS``) and a name part."""
    found = [n for n in summary.nodes if _matches(n, kind, query)]
    pages = max(1, -(-len(found) // PAGE_SIZE))
    page = min(max(page, 1), pages)
    rows = []
    for node in found[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]:
        serving = ", ".join(f"{e(name)}={_version(summary, digest)}" for name, digest in node.serving) or "—"
        holding = ", ".join(f"{_version(summary, d)} {e(state)} {pct}%" for d, state, pct in node.inventory) or "—"
        problem = e(f"{node.problems[0].reason}: {node.problems[0].message[:120]}") if node.problems else ""
        rows.append([
            f'<b class="node">{e(node.name)}</b>' + (' <span class="stale">stale</span>' if node.stale else ""),
            e(node.role), e(f"{node.region}/{node.cluster}"), serving, holding, problem, _when(node.last_seen),
        ])  # fmt: skip
    table = _table(["node", "role", "where", "serving", "on disk", "problem", "last heartbeat"], rows, "nodes")
    return (
        f'<div class="pager" data-page="{page}" data-pages="{pages}">'
        f'<button type="button" data-goto="{page - 1}" {"disabled" if page <= 1 else ""}>‹ previous</button> '
        f"page {page} of {pages} · {len(found)} nodes "
        f'<button type="button" data-goto="{page + 1}" {"disabled" if page >= pages else ""}>next ›</button></div>{table}'
    )
