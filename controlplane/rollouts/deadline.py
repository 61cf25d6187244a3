"""The progress deadline: how long a step may wait on the fleet before the rollout aborts.

Argo's fixed 600 s default was sized for container images of a few hundred MB; a 140 GB model
at a few hundred MB/s per node needs longer just to arrive. So unless the spec sets
``progressDeadlineSeconds``, the deadline is sized from what is being moved and how fast this fleet
moves bytes::

    deadline = max(600 s, 2 × version_bytes / fetch_rate + 300 s)

``fetch_rate`` is the per-node fetch throughput the fleet measured recently (nodes fetch in
parallel and feed each other, so per-node time is the long pole). The factor 2 absorbs a slow node
or a cold cache tier; the 300 s covers loading weights onto GPUs and the model server's warm-up.
With no measurement yet, a conservative 50 MiB/s is assumed. A rate below 1 MiB/s is treated as
1 MiB/s, so a stalled fleet cannot stretch the deadline without bound.

The deadline applies only to the steps that wait on the fleet — ``prefetch`` and ``setWeight`` —
and is armed when such a step is entered, from the observations of that moment, so a fleet that
slows down afterwards cannot postpone its own abort. Time spent manually paused does not count: a
resume moves the deadline forward by the paused time. On expiry the rollout aborts (Argo's
``progressDeadlineAbort``, which defaults to off there, is always on here).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ASSUMED_FETCH_RATE", "MINIMUM_DEADLINE_SECONDS", "Deadline", "progress_deadline"]

MINIMUM_DEADLINE_SECONDS = 600.0
LOAD_MARGIN_SECONDS = 300.0
TRANSFER_FACTOR = 2.0
ASSUMED_FETCH_RATE = 50 * 1024 * 1024
SLOWEST_COUNTED_RATE = 1024 * 1024


@dataclass(frozen=True)
class Deadline:
    """A deadline length and how it was arrived at (shown in status messages)."""

    seconds: float
    basis: str


def progress_deadline(spec_seconds: float | None, version_bytes: int, fetch_rate_bytes_per_s: float | None) -> Deadline:
    """The deadline for a fleet-waiting step: the spec's, or one sized from bytes and fetch rate."""
    if spec_seconds is not None:
        return Deadline(spec_seconds, "progressDeadlineSeconds from the spec")
    measured = fetch_rate_bytes_per_s is not None and fetch_rate_bytes_per_s > 0
    rate = max(fetch_rate_bytes_per_s or 0.0, SLOWEST_COUNTED_RATE) if measured else float(ASSUMED_FETCH_RATE)
    transfer = max(version_bytes, 0) / rate
    seconds = max(MINIMUM_DEADLINE_SECONDS, TRANSFER_FACTOR * transfer + LOAD_MARGIN_SECONDS)
    source = "measured" if measured else "assumed (nothing measured yet)"
    basis = f"sized from {version_bytes} bytes at {rate / 1e6:.1f} MB/s {source}"
    return Deadline(round(seconds, 3), basis)
