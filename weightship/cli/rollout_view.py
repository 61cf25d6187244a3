"""How ``weightship rollout`` shows a rollout to people: where it is, what it measured, who serves what.

One view for a fleet rollout and a Kubernetes ``ModelRollout`` (both arrive as a ``Rollout``):

- a head line: phase (coloured), the rollout's message;
- the facts: deployment, version and stable (whole digests, never wrapped), weight, step, attempt;
- the steps, each done / current / pending;
- the analysis runs, one row per measurement (metric, verdict, value, when, message);
- per version digest the nodes (pods, for a ModelRollout) serving it, and how many hold the
  canary staged out of how many targets.

As in ``weightship.cli.display``, user-supplied text is never read as markup, and digests are
``no_wrap`` cells; the console prints unbounded rows off a terminal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from weightship.cli.display import short_digest
from weightship.schemas import Rollout

__all__ = ["PHASE_STYLES", "rollout_view", "rollouts_table"]

#: Colour of each phase; unknown phases (``Invalid``, ``Pending`` on Kubernetes) stay plain or red.
PHASE_STYLES = {
    "Healthy": "bold green",
    "Progressing": "bold cyan",
    "Paused": "bold yellow",
    "Degraded": "bold red",
    "Invalid": "bold red",
}
_VERDICT_STYLES = {"Successful": "green", "Failed": "red", "Error": "red", "Inconclusive": "yellow"}
_STATE_MARKS = {"done": ("✓ done", "green"), "current": ("▶ current", "bold cyan"), "pending": ("· pending", "dim")}


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%SZ") if at else "-"


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _step_label(r: Rollout) -> str:
    if r.completed:
        return f"{r.steps_total}/{r.steps_total} (completed)"
    return f"{min(r.step_index + 1, r.steps_total)}/{r.steps_total}"


def rollout_view(r: Rollout, *, unit: str = "nodes") -> RenderableType:
    """``weightship rollout status``: see the module docstring; ``unit`` is ``pods`` for a ModelRollout."""
    head = Text.assemble(
        ("rollout ", "bold"), (r.id, "bold"), " of ", (r.deployment, "bold"), ": ",
        (r.phase, PHASE_STYLES.get(r.phase, "bold")),
    )  # fmt: skip
    if r.aborted:
        head.append(" (aborted)", style="red")
    if r.message:
        head.append(f" — {r.message}")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(no_wrap=True)
    for key, value in (
        ("model", r.model or "-"),
        ("version", r.version),
        ("stable", r.stable or "-"),
        ("weight", f"{r.weight:g}% canary"),
        ("step", _step_label(r)),
        ("attempt", str(r.attempt)),
        ("created", f"{_when(r.created_at)} by {r.created_by}"),
        ("updated", _when(r.updated_at)),
    ):
        facts.add_row(key, Text(value))
    parts: list[RenderableType] = [head, facts]
    if r.steps:
        steps = Table("#", "STEP", "STATE", title="steps", title_justify="left")
        for s in r.steps:
            mark, style = _STATE_MARKS.get(s.state, (s.state, ""))
            steps.add_row(str(s.index + 1), Text(s.summary), Text(mark, style=style))
        parts.append(steps)
    rows = [(run, m, x) for run in r.analysis_runs for m in run.metrics for x in m.measurements]
    if r.analysis_runs:
        runs = Table("RUN", "STEP", "METRIC", "#", "VERDICT", "VALUE", "AT", "MESSAGE", title="analysis")
        runs.title_justify = "left"
        for run in r.analysis_runs:
            verdict = Text(run.phase, style=_VERDICT_STYLES.get(run.phase, ""))
            runs.add_row(Text(run.id), str(run.step_index + 1), "(run)", "", verdict, "", "", "")
            for m in run.metrics:
                for x in m.measurements:
                    runs.add_row(
                        "", "", Text(m.name), str(x.index + 1),
                        Text(x.phase, style=_VERDICT_STYLES.get(x.phase, "")), Text(_value(x.value)),
                        _when(x.finished_at or x.started_at), Text(x.message),
                    )  # fmt: skip
        if not rows:
            runs.caption = "no measurements yet"
        parts.append(runs)
    nodes = Table("ROLE", "DIGEST", unit.upper(), title=f"{unit} serving each version", title_justify="left")
    nodes.columns[1].no_wrap = True
    for digest, count in sorted(r.nodes.items(), key=lambda item: -item[1]):
        role = "canary" if digest == r.version else "stable" if digest == r.stable else "other"
        nodes.add_row(role, digest, str(count))
    if not r.nodes:
        nodes.add_row("-", "-", "0")
    parts.append(nodes)
    if unit == "nodes":  # pods have no staging of their own: their node's agent stages
        staged = f"{r.staged_nodes} of {r.target_nodes} target nodes hold {short_digest(r.version)} staged"
        parts.append(Text(staged, style="dim"))
    return Group(*parts)


def rollouts_table(rollouts: Sequence[Rollout]) -> Table:
    """``weightship rollout list``: newest first."""
    table = Table(
        "ID",
        "DEPLOYMENT",
        "VERSION",
        "PHASE",
        "STEP",
        "WEIGHT",
        "CREATED",
        "BY",
        title="rollouts",
        title_justify="left",
    )
    for r in rollouts:
        table.add_row(
            Text(r.id), Text(r.deployment), short_digest(r.version),
            Text(r.phase, style=PHASE_STYLES.get(r.phase, "")), _step_label(r), f"{r.weight:g}%",
            _when(r.created_at), Text(r.created_by),
        )  # fmt: skip
    return table
