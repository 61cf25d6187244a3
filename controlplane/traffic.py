"""Per-version serving traffic across the fleet: samples of the model servers' counters and windows over them.

Model servers count requests, errors, latency, load failures and validation results per version;
each node's agent sums its servers' counters and sends them in its heartbeat (``NodeHeartbeat.serve``,
monotonic from the agent's ``since``). The heartbeat path stores them with the rest of the report
and does nothing else: no extra query per heartbeat.

A figure *over a window* (requests in the last minute, the p99 of that minute) is the difference
between the counters now and the counters at the window's start, so the start must have been
recorded: :func:`sample_forever` copies every live node's counters into one ``serve_samples`` row
every ``serve_sample_seconds`` and deletes rows older than the retention. :func:`window` then
reads the live reports ("now") and the newest sample at or before ``now - seconds`` ("start").

**Resets.** Per node and (deployment, version), the difference is taken only when both ends have
the same ``since`` and no counter went down; otherwise the node's counters restarted (agent
restarted) and the whole current value counts as the window's. A rate is never negative. Nodes
that went stale drop out of "now" and add nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.persistence.engine import database_errors
from controlplane.persistence.rows import NodeRow, ServeSampleRow, utcnow
from weightship.errors import TemporaryError
from weightship.logs import event
from weightship.schemas import SERVE_COUNTERS, SERVE_LATENCY_BOUNDS, NodeServeMetrics, counters_reset

__all__ = [
    "FleetSample",
    "NodeSample",
    "Totals",
    "Window",
    "live_sample",
    "sample_forever",
    "take_sample",
    "window",
    "windows",
]

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (deployment, digest)


@dataclass(frozen=True)
class Totals:
    """One version's counters (cumulative, or the difference over a window)."""

    requests: int = 0
    errors: int = 0
    load_failures: int = 0
    validations_passed: int = 0
    validations_failed: int = 0
    #: cumulative latency histogram over ``SERVE_LATENCY_BOUNDS`` + +Inf; empty: nothing observed
    latency_le: tuple[int, ...] = ()

    @classmethod
    def of(cls, counts: Iterable[int], latency_le: tuple[int, ...]) -> Totals:
        """Totals from the five counters in ``SERVE_COUNTERS`` order and a histogram."""
        values = dict(zip(SERVE_COUNTERS, (int(c) for c in counts), strict=True))
        return cls(**values, latency_le=latency_le)

    def since(self, base: Totals | None) -> Totals:
        """What grew from ``base`` to this; all of it when ``base`` is None or any counter went down (a reset)."""
        if base is None or counters_reset(base, self):
            return self
        le = self.latency_le
        if base.latency_le:
            le = tuple(b - a for a, b in zip(base.latency_le, self.latency_le, strict=True))
        return Totals.of((getattr(self, n) - getattr(base, n) for n in SERVE_COUNTERS), le)

    def plus(self, other: Totals) -> Totals:
        """The sum of two nodes' figures."""
        if not self.latency_le or not other.latency_le:
            le = self.latency_le or other.latency_le
        else:
            le = tuple(a + b for a, b in zip(self.latency_le, other.latency_le, strict=True))
        return Totals.of((getattr(self, n) + getattr(other, n) for n in SERVE_COUNTERS), le)

    def latency_buckets(self) -> tuple[tuple[float, int], ...]:
        """``(upper bound, cumulative count)`` pairs ending with ``+inf``; empty when nothing was observed."""
        if len(self.latency_le) != len(SERVE_LATENCY_BOUNDS) + 1:
            return ()
        return tuple(zip((*SERVE_LATENCY_BOUNDS, float("inf")), self.latency_le, strict=True))

    def encode(self, key: _Key) -> list[Any]:
        """The compact JSON row of a sample."""
        return [*key, *(getattr(self, n) for n in SERVE_COUNTERS), list(self.latency_le)]

    @classmethod
    def decode(cls, row: list[Any]) -> tuple[_Key, Totals]:
        """Inverse of :meth:`encode`."""
        deployment, digest, *counts, le = row
        return (str(deployment), str(digest)), cls.of(counts, tuple(int(x) for x in le))


@dataclass(frozen=True)
class NodeSample:
    """One node's counters at one moment; ``since`` identifies the run of its counters."""

    since: str
    counters: dict[_Key, Totals]
    queue_depth: dict[_Key, int] = field(default_factory=dict)


#: node id -> that node's counters
FleetSample = dict[str, NodeSample]


@dataclass(frozen=True)
class Window:
    """Per-version figures of one deployment over ``[start, end]`` (``start``: the sample the window began at)."""

    start: datetime
    end: datetime
    versions: dict[str, Totals]

    @property
    def seconds(self) -> float:
        """The window's actual length."""
        return max(0.0, (self.end - self.start).total_seconds())


def _node_sample(report: dict[str, Any]) -> NodeSample | None:
    raw = report.get("serve")
    if not raw:
        return None
    try:
        serve = NodeServeMetrics.model_validate(raw)
    except PydanticValidationError:
        return None  # written by an agent of another version: its traffic is not counted
    counters: dict[_Key, Totals] = {}
    queued: dict[_Key, int] = {}
    for v in serve.versions:
        key = (v.deployment, v.digest)
        counters[key] = Totals.of((getattr(v, n) for n in SERVE_COUNTERS), tuple(v.latency_le))
        queued[key] = v.queue_depth
    return NodeSample(serve.since.isoformat(), counters, queued)


def live_sample(session: Session, now: datetime, stale_seconds: float) -> FleetSample:
    """The counters every live node reported last."""
    # Only the reports' ``serve`` part, extracted by the database: parsing every whole report (the
    # inventory is most of it) held the interpreter for hundreds of ms per sample in a large fleet.
    serve = NodeRow.report["serve"].as_string()  # its JSON text; NULL when the report has none
    rows = session.execute(
        select(NodeRow.id, serve).where(
            NodeRow.last_seen >= now - timedelta(seconds=stale_seconds), serve.is_not(None)
        )
    ).all()
    fleet: FleetSample = {}
    for node_id, text in rows:
        sample = _node_sample({"serve": json.loads(text)})
        if sample is not None:
            fleet[node_id] = sample
    return fleet


def _encode(fleet: FleetSample) -> dict[str, Any]:
    return {n: {"since": s.since, "v": [t.encode(k) for k, t in s.counters.items()]} for n, s in fleet.items()}


def _decode(data: dict[str, Any]) -> FleetSample:
    fleet: FleetSample = {}
    for node_id, raw in data.items():
        try:
            fleet[node_id] = NodeSample(str(raw["since"]), dict(Totals.decode(row) for row in raw["v"]))
        except (KeyError, TypeError, ValueError):
            continue  # a row this code cannot read: that node's window starts at its counters' start
    return fleet


def take_sample(session: Session, now: datetime, stale_seconds: float, retention_seconds: float) -> None:
    """Record the live counters as a sample at ``now`` and delete samples older than the retention."""
    session.add(ServeSampleRow(at=now, data=_encode(live_sample(session, now, stale_seconds))))
    session.execute(delete(ServeSampleRow).where(ServeSampleRow.at < now - timedelta(seconds=retention_seconds)))
    session.commit()


def _start_sample(session: Session, start: datetime) -> ServeSampleRow | None:
    found = session.scalars(
        select(ServeSampleRow).where(ServeSampleRow.at <= start).order_by(ServeSampleRow.at.desc()).limit(1)
    ).first()
    if found is None:
        found = session.scalars(select(ServeSampleRow).order_by(ServeSampleRow.at).limit(1)).first()
    return found


def window(session: Session, deployment: str, seconds: float, now: datetime, stale_seconds: float) -> Window | None:
    """``deployment``'s per-version figures over the last ``seconds``; None until samples cover half of it.

    The window starts at the newest sample at or before ``now - seconds`` (or, just after start-up,
    the oldest sample if that covers at least half the window), so it may be a little longer than
    asked; :attr:`Window.seconds` is the length actually measured, which rates divide by.
    """
    return windows(session, [deployment], seconds, now, stale_seconds)[deployment]


def windows(
    session: Session,
    deployments: Iterable[str],
    seconds: float,
    now: datetime,
    stale_seconds: float,
    live: FleetSample | None = None,
) -> dict[str, Window | None]:
    """:func:`window` for several deployments, reading the start sample once (and the nodes, unless ``live``)."""
    wanted = list(deployments)
    start_row = _start_sample(session, now - timedelta(seconds=seconds))
    if start_row is None or (now - start_row.at).total_seconds() < seconds / 2:
        return dict.fromkeys(wanted)
    start = _decode(start_row.data or {})
    found: dict[str, Window | None] = {name: Window(start_row.at, now, {}) for name in wanted}
    live = live_sample(session, now, stale_seconds) if live is None else live
    for node_id, sample in live.items():
        base = start.get(node_id)
        for (name, digest), totals in sample.counters.items():
            into = found.get(name)
            if into is None:
                continue
            before = base.counters.get((name, digest)) if base is not None and base.since == sample.since else None
            into.versions[digest] = into.versions.get(digest, Totals()).plus(totals.since(before))
    return found


async def sample_forever(
    sessions: sessionmaker[Session], every: float, stale_seconds: float, retention_seconds: float
) -> None:
    """Take a sample every ``every`` seconds until cancelled; a database outage skips samples, never stops."""
    while True:
        await asyncio.sleep(every)  # ok-sleep: the sampling period itself
        try:
            await asyncio.to_thread(_sample_once, sessions, stale_seconds, retention_seconds)
        except TemporaryError as exc:
            event(log, "traffic.sample_failed", logging.WARNING, error=exc.message)


def _sample_once(sessions: sessionmaker[Session], stale_seconds: float, retention_seconds: float) -> None:
    with database_errors("sampling serving counters"), sessions() as session:
        take_sample(session, utcnow(), stale_seconds, retention_seconds)
