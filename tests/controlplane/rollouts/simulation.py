"""A tiny in-memory stand-in for a rollout driver, so engine tests read like scenarios.

It plays the driver's part honestly: it carries out the engine's actions (pointer writes with
compare-and-swap on the epoch, measurements answered from a script), reports what it sees as
``Observations``, keeps every measurement it ever took (the engine must ignore the ones it already
counted), and moves a fake clock — no test ever sleeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from controlplane.rollouts.actions import Action, MeasureMetric, SetPointer, StageVersion
from controlplane.rollouts.engine import Reconciliation, reconcile
from controlplane.rollouts.observations import FleetObservation, MeasurementResult, Observations, PointerObservation
from controlplane.rollouts.phases import Phase
from controlplane.rollouts.spec import RolloutSpec
from controlplane.rollouts.status import RolloutStatus

STABLE = "sha256:" + "1" * 64
CANARY = "sha256:" + "2" * 64
OTHER = "sha256:" + "3" * 64
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@dataclass(frozen=True)
class ProviderFailure:
    """A scripted provider error (timeout, HTTP 500) instead of a value."""

    text: str


@dataclass
class World:
    """The deployment, its fleet and its metrics, as a driver would observe and change them."""

    spec: RolloutSpec
    stable: str | None = STABLE
    canary: str | None = None
    share: float = 0.0
    epoch: int = 1
    target_nodes: int = 4
    staged_nodes: int = 4
    stage_failures: tuple[str, ...] = ()
    canary_nodes_ready: bool = True
    version_bytes: int = 10 * 10**9
    fetch_rate: float | None = 500 * 10**6
    now: datetime = T0
    status: RolloutStatus | None = None
    #: Scripted answers per (step index, metric name); the last one repeats. Default: 0.001.
    answers: dict[tuple[int, str], list[object]] = field(default_factory=dict)
    results: list[MeasurementResult] = field(default_factory=list)
    pointer_writes: list[SetPointer] = field(default_factory=list)
    staged_requests: list[StageVersion] = field(default_factory=list)
    last: Reconciliation | None = None

    def observe(self) -> Observations:
        """What the driver sees right now."""
        assigned = math.ceil(self.share * self.target_nodes) if self.canary else 0
        return Observations(
            pointer=PointerObservation(self.stable, self.canary, self.share, self.epoch),
            fleet=FleetObservation(
                target_nodes=self.target_nodes,
                staged_nodes=self.staged_nodes,
                canary_assigned=assigned,
                canary_serving=assigned if self.canary_nodes_ready else 0,
                stage_failures=self.stage_failures,
            ),
            version_bytes=self.version_bytes,
            fetch_rate_bytes_per_s=self.fetch_rate,
            measurements=tuple(self.results),
        )

    def reconcile(self) -> Reconciliation:
        """One engine call on the current observations, without carrying out its actions."""
        self.last = reconcile(self.spec, self.status, self.observe(), self.now)
        self.status = self.last.status
        return self.last

    def tick(self, seconds: float = 0.0) -> Reconciliation:
        """Reconcile, carry out every action, then let ``seconds`` pass."""
        result = self.reconcile()
        for action in result.actions:
            self.apply(action)
        self.now += timedelta(seconds=seconds)
        return result

    def apply(self, action: Action) -> None:
        """Carry out one action the way a driver would."""
        if isinstance(action, SetPointer):
            if action.expected_epoch != self.epoch:
                return  # the compare-and-swap lost; the next reconcile sees the new pointer
            self.stable, self.canary, self.share = action.stable, action.canary, action.canary_share
            self.epoch += 1
            self.pointer_writes.append(action)
        elif isinstance(action, StageVersion):
            self.staged_requests.append(action)
        elif isinstance(action, MeasureMetric):
            step = int(action.run_id.rsplit("-s", 1)[1])
            script = self.answers.get((step, action.metric), [0.001])
            answer = script[min(action.index, len(script) - 1)]
            if isinstance(answer, ProviderFailure):
                result = MeasurementResult(action.run_id, action.metric, action.index, self.now, error=answer.text)
            else:
                result = MeasurementResult(action.run_id, action.metric, action.index, self.now, value=answer)
            self.results.append(result)

    def run(self, *, until: Phase | None = None, ticks: int = 500, seconds: float = 30.0) -> RolloutStatus:
        """Tick until the phase is ``until`` (or the rollout completes) and the actions ran dry."""
        for _ in range(ticks):
            result = self.tick(seconds)
            done = result.status.completed or (until is not None and result.status.phase is until)
            # StageVersion is repeated while a rollout runs (keep it staged); it is not progress.
            if done and not [a for a in result.actions if not isinstance(a, StageVersion)]:
                return result.status
        raise AssertionError(f"no {until or 'completion'} after {ticks} ticks: {self.status}")

    @property
    def pointer(self) -> tuple[str | None, str | None, float]:
        """The pointer as (stable, canary, share)."""
        return self.stable, self.canary, self.share
