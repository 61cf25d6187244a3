"""The steps of a rollout spec as people read them: ``setWeight 25%``, ``pause 10m``, ``analysis error-rate``.

The spec's steps are JSON in Argo Rollouts' casing (``docs/rollouts.md``); the engine parses and
checks them. This module only words them for a status view, from the raw JSON, so that a
``ModelRollout`` read from Kubernetes and a fleet rollout show the same lines. A step it cannot
read is shown as it is, never refused: checking is the engine's job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

from weightship.schemas import RolloutStep

__all__ = ["step_summary", "steps_of"]

StepKind = Literal["setWeight", "pause", "analysis", "prefetch"]


def step_summary(step: object) -> tuple[StepKind | None, str]:
    """The kind of ``step`` and one line saying what it does (kind ``None``: not a step this reads)."""
    if not isinstance(step, Mapping) or len(step) != 1:
        return None, json.dumps(step, sort_keys=True, default=str)
    kind, body = next(iter(step.items()))
    if kind == "setWeight":
        return "setWeight", f"set canary weight to {body}%"
    if kind == "pause":
        duration = body.get("duration") if isinstance(body, Mapping) else None
        return "pause", f"pause {duration}" if duration is not None else "pause until promoted"
    if kind == "prefetch":
        percent = body.get("percent", 100) if isinstance(body, Mapping) else 100
        return "prefetch", f"stage the version on {percent}% of target nodes before traffic moves"
    if kind == "analysis":
        metrics = body.get("metrics") if isinstance(body, Mapping) else None
        names = [str(m.get("name")) for m in metrics or [] if isinstance(m, Mapping)]
        return "analysis", f"analysis: {', '.join(names) or 'no metrics'}"
    return None, json.dumps(step, sort_keys=True, default=str)


def steps_of(steps: Sequence[Any], step_index: int, *, completed: bool) -> list[RolloutStep]:
    """``steps`` with their summaries and where the rollout is: done, current, pending."""
    out = []
    for index, step in enumerate(steps):
        kind, summary = step_summary(step)
        if completed or index < step_index:
            state: Literal["done", "current", "pending"] = "done"
        else:
            state = "current" if index == step_index else "pending"
        # An unreadable step keeps its JSON as summary; its kind is a placeholder, not a claim.
        out.append(
            RolloutStep.model_construct(index=index, kind=cast(StepKind, kind or "?"), summary=summary, state=state)
        )
    return out
