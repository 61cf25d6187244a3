"""Model servers' serving counters: what a server pushes to its agent, and what a node sums into its heartbeat."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from pydantic import Field, model_validator

from weightship.schemas.base import Count, Digest, Measure, Name, Schema

__all__ = [
    "SERVE_COUNTERS",
    "SERVE_LATENCY_BOUNDS",
    "NodeServeMetrics",
    "ServeCounters",
    "ServeReport",
    "VersionServeMetrics",
    "counters_reset",
]

#: the cumulative counters of ``ServeCounters``, in the order readers encode them (queue depth is a gauge)
SERVE_COUNTERS = ("requests", "errors", "load_failures", "validations_passed", "validations_failed")

#: upper bounds (seconds) of the model servers' latency histogram buckets; a last, implicit +Inf follows
SERVE_LATENCY_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeCounters(Schema):
    """One version's cumulative serving counters, as a model server (or a node's sum of them) counts them.

    Counters only grow while their counter (a model server, an agent) lives; a restart starts them
    from 0 again, which readers detect (a counter lower than before, or a new ``since``/instance).
    ``latency_le`` is the cumulative latency histogram over ``SERVE_LATENCY_BOUNDS`` plus +Inf
    (``latency_le[i]``: requests answered within bound ``i``); empty when nothing was observed.
    """

    digest: Digest
    requests: Count = Field(default=0, description="inference requests this version answered (any status)")
    errors: Count = Field(default=0, description="of those, server-side failures (5xx)")
    latency_le: list[Count] = Field(default_factory=list, max_length=len(SERVE_LATENCY_BOUNDS) + 1)
    latency_sum: Measure = 0.0
    load_failures: Count = Field(default=0, description="loads of this version that failed (start-up failures)")
    validations_passed: Count = 0
    validations_failed: Count = Field(default=0, description="loads whose validation (golden check, NaN scan) failed")
    queue_depth: Count = Field(default=0, description="gauge: requests waiting for this version right now")

    @model_validator(mode="after")
    def _histogram_shape(self) -> ServeCounters:
        le = self.latency_le
        if le and (len(le) != len(SERVE_LATENCY_BOUNDS) + 1 or any(b < a for a, b in itertools.pairwise(le))):
            raise ValueError(
                f"latency_le must hold {len(SERVE_LATENCY_BOUNDS) + 1} cumulative (non-decreasing) bucket counts"
            )
        return self


class ServeReport(Schema):
    """``POST /local/v1/serve-metrics``: a model server's cumulative counters per version, pushed periodically.

    ``instance`` names the model-server process (random per start); the agent turns a new instance
    or a counter that went down into a reset, so a restarted server never makes rates negative.
    """

    deployment: Name
    instance: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    versions: list[ServeCounters] = Field(default_factory=list, max_length=32)


class VersionServeMetrics(ServeCounters):
    """A node's serving counters for one deployment and version: the sum over its model servers."""

    deployment: Name
    instances: Count = Field(default=0, description="model servers on the node that reported this version")


class NodeServeMetrics(Schema):
    """What a node's model servers reported, summed per deployment and version (in the heartbeat).

    Counters are monotonic from ``since`` (when the agent started counting); a changed ``since``
    means they restarted from 0.
    """

    since: datetime
    versions: list[VersionServeMetrics] = Field(default_factory=list, max_length=32)


class Counted(Protocol):
    """Anything holding the cumulative serve counters: ``ServeCounters``, a reader's own totals."""

    @property
    def requests(self) -> int: ...
    @property
    def errors(self) -> int: ...
    @property
    def load_failures(self) -> int: ...
    @property
    def validations_passed(self) -> int: ...
    @property
    def validations_failed(self) -> int: ...
    @property
    def latency_le(self) -> Sequence[int]: ...


def counters_reset(before: Counted, now: Counted) -> bool:
    """Whether ``now``'s counters restarted since ``before``: a counter or histogram bucket went down, or the histogram went.

    Counters only grow while their counter lives, so a lower value means a restart from 0: the
    reader takes ``now`` whole instead of a (negative) difference.
    """
    if any(getattr(now, name) < getattr(before, name) for name in SERVE_COUNTERS):
        return True
    old, new = before.latency_le, now.latency_le
    return bool(old) and (len(old) != len(new) or any(b < a for a, b in zip(old, new, strict=True)))
