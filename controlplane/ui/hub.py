"""The status page's one broadcaster per process: every open page is fed from one shared summary.

A page holds a server-sent-events stream (``GET /ui/events``). The streams never query the
database themselves: they wait on the ``Hub``, which holds the latest ``Summary``
(``controlplane.ui.summary``) already rendered into the payload every page receives, and a
version number bumped whenever that payload changes. So 50 open pages cost what one costs.

The hub re-reads the summary only while at least one page is open, and only when something may
have changed:

- the change feed (``controlplane.notify``) announces a pointer move (``deployments``), a preheat
  or warm pool (``staging``), a rollout created or acted on (``rollouts``), or a reconnect
  (``resync``): the same announcements that wake the agents' long-polls;
- a node's report changed in this process (the fleet's memo of the report hash it last wrote,
  ``FleetMemos.reports_written``, looked at in memory every ``POLL_SECONDS``: no query); in a busy
  fleet, where reports change all the time, such reads keep ``READ_SHARE_GAP`` times the last
  read's duration apart, so the page never spends more than a fifth of a core reading;
- every ``RECHECK_SECONDS`` while something may change unannounced: on PostgreSQL (heartbeats
  that reached another replica), while a rollout is active (measurements the rollout driver
  stored, a timed pause ending);
- when the first live node of the summary held would have gone stale by now.

Reads are debounced (``DEBOUNCE_SECONDS``: a burst of changes is one read) and never overlap. With
no page open the hub's task ends: the page costs nothing while nobody watches. Each read also
appends one point to the charts' time series (bytes per source, serving signals per version), so
the series covers the time someone watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta

from starlette.concurrency import run_in_threadpool

from controlplane.notify import DEPLOYMENTS, RESYNC, STAGING
from controlplane.persistence.rows import utcnow
from controlplane.rollout_resources import ROLLOUTS
from controlplane.state import AppState
from controlplane.ui.render import render_sections
from controlplane.ui.summary import ServeTotals, Summary, read_summary
from weightship.logs import event

__all__ = ["DEBOUNCE_SECONDS", "IDLE_MAX_AGE", "POINTS", "POLL_SECONDS", "READ_SHARE_GAP", "RECHECK_SECONDS", "Hub", "Series"]

log = logging.getLogger(__name__)

#: a burst of changes within this long is one read
DEBOUNCE_SECONDS = 0.15
#: how often the hub looks (in memory) for reports this process wrote
POLL_SECONDS = 1.0
#: the backstop re-read while a page is open
RECHECK_SECONDS = 10.0
#: reads prompted by changed reports wait this many times the last read's duration after it (at
#: most a fifth of the time spent reading: 5,000 nodes take about 0.5 s to read)
READ_SHARE_GAP = 5.0
#: with no stream open, a page load or node page re-reads a summary older than this
IDLE_MAX_AGE = 5.0
#: points kept per chart series
POINTS = 240

_WAKING_TOPICS = frozenset({DEPLOYMENTS, STAGING, ROLLOUTS, RESYNC})


@dataclass
class Series:
    """The charts' time series: one point per summary read while someone watched."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=POINTS))
    #: source kind -> cumulative bytes delivered, in MiB
    bytes: dict[str, deque[float | None]] = field(default_factory=dict)
    #: "deployment version" -> signal -> values (error %, mean latency ms, queue depth)
    serve: dict[str, dict[str, deque[float | None]]] = field(default_factory=dict)
    last_serve: dict[tuple[str, str], ServeTotals] = field(default_factory=dict)

    def add(self, at: float, summary: Summary, label: Callable[[str], str]) -> None:
        """Append one point taken from ``summary``."""
        self.times.append(at)
        for kind, value in summary.bytes_by_source.items():
            self._column(self.bytes, kind).append(value / 2**20)
        seen: set[str] = set()
        for (deployment, digest), totals in summary.serve.items():
            name = f"{deployment} {label(digest)}"
            seen.add(name)
            before = self.last_serve.get((deployment, digest))
            requests = totals.requests - (before.requests if before else 0)
            # a counter that went down is a restarted model server: that interval shows nothing
            rate = requests > 0 and before is not None
            signals = self.serve.setdefault(name, {})
            self._column(signals, "error_percent").append(100 * (totals.errors - before.errors) / requests if rate and before else None)
            self._column(signals, "latency_ms").append(1000 * (totals.latency_sum - before.latency_sum) / requests if rate and before else None)
            self._column(signals, "queue_depth").append(float(totals.queue_depth))
        for name, signals in self.serve.items():
            if name not in seen:
                for values in signals.values():
                    values.append(None)
        self.last_serve = dict(summary.serve)

    def _column(self, table: dict[str, deque[float | None]], key: str) -> deque[float | None]:
        column = table.get(key)
        if column is None:
            # a series that starts late is empty before: pad so every column lines up with times
            column = table[key] = deque([None] * (len(self.times) - 1), maxlen=POINTS)
        return column

    def charts(self) -> dict[str, object]:
        """The series as uPlot data: ``[times, column, ...]`` per chart."""
        times = list(self.times)
        return {
            "bytes": {"names": list(self.bytes), "data": [times, *(list(c) for c in self.bytes.values())]},
            "serve": {
                name: {"names": list(signals), "data": [times, *(list(c) for c in signals.values())]}
                for name, signals in sorted(self.serve.items())
            },
        }


class Hub:
    """This process's broadcaster of the page's summary; ``on_change`` listens to the change feed."""

    def __init__(
        self,
        state: AppState,
        *,
        reader: Callable[[AppState], Summary] = read_summary,
        debounce: float = DEBOUNCE_SECONDS,
        poll: float = POLL_SECONDS,
        recheck: float = RECHECK_SECONDS,
    ) -> None:
        self._state = state
        self._reader = reader
        self._debounce = debounce
        self._poll = poll
        self._recheck = recheck
        self.summary: Summary | None = None
        #: what every page receives: the summary rendered, as one JSON text
        self.payload = ""
        #: bumped whenever ``payload`` changes
        self.version = 0
        #: summary reads so far (the bench and tests count them)
        self.reads = 0
        self.series = Series()
        self._watchers = 0
        self._changed = asyncio.Event()
        self._published = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reports_seen: int | None = None
        self._read_at = 0.0
        #: how long the last summary read took
        self._read_seconds = 0.0
        self.draining = False

    @property
    def watchers(self) -> int:
        """Open streams right now."""
        return self._watchers

    def on_change(self, topic: str) -> None:
        """Change-feed listener: re-read soon, if anyone watches."""
        if topic in _WAKING_TOPICS:
            self._changed.set()

    def wake(self) -> None:
        """Wake every stream without a new payload (each looks at its session again)."""
        self._publish()

    def drain(self) -> None:
        """The process is stopping: end every stream (the server waits for open requests)."""
        self.draining = True
        self._publish()

    async def current(self) -> Summary:
        """The summary held: kept current while a stream is open, else re-read when older than ``IDLE_MAX_AGE``."""
        idle = self._task is None or self._task.done()
        if self.summary is None or (idle and time.monotonic() - self._read_at > IDLE_MAX_AGE):
            await self._read()
        assert self.summary is not None
        return self.summary

    async def updates(self, keepalive: float) -> AsyncIterator[str | None]:
        """Each new payload while the caller iterates (``None`` after ``keepalive`` seconds of quiet)."""
        self._watchers += 1
        if self._task is None or self._task.done():
            self._changed.set()  # what is held may be old: nobody kept it current
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ui-hub")
        try:
            sent = -1
            while not self.draining:
                if self.version != sent and self.payload:
                    sent = self.version
                    yield self.payload
                    continue
                published = self._published
                try:
                    await asyncio.wait_for(published.wait(), timeout=keepalive)
                except TimeoutError:
                    yield None
                    continue
                if self.version == sent:
                    yield None  # woken without a new payload
        finally:
            self._watchers -= 1

    def _publish(self) -> None:
        self._published.set()
        self._published = asyncio.Event()

    def _unannounced_changes(self) -> bool:
        """Whether the summary may change with nothing announced here: other replicas, an active rollout."""
        if self._state.engine.dialect.name != "sqlite":
            return True
        views = self.summary.deployments if self.summary is not None else ()
        return any(v.rollout is not None and not (v.rollout.completed or v.rollout.aborted) for v in views)

    def _stale_due(self) -> bool:
        """Whether a node shown live would have gone stale by now (staleness is the passing of time)."""
        if self.summary is None:
            return False
        seen = [n.last_seen for n in self.summary.nodes if not n.stale and n.last_seen is not None]
        if not seen:
            return False
        deadline = min(seen) + timedelta(seconds=self._state.settings.node_stale_seconds)
        return utcnow() > deadline + timedelta(seconds=1)

    def _reports_fingerprint(self) -> int:
        return hash(tuple(v[0] for v in self._state.fleet.reports_written.values()))

    async def _read(self) -> None:
        self.reads += 1
        self._read_at = started = time.monotonic()
        summary = await run_in_threadpool(self._reader, self._state)
        self._read_seconds = time.monotonic() - started
        self.series.add(time.time(), summary, lambda d: _label(summary, d))
        payload = json.dumps(
            {"at": summary.at.isoformat(), "html": render_sections(summary), "charts": self.series.charts()},
            separators=(",", ":"),
        )
        self.summary = summary
        if payload != self.payload:
            self.payload = payload
            self.version += 1
            self._publish()

    async def _run(self) -> None:
        """Keep the summary current while anyone watches; ends when nobody does."""
        last_read = 0.0
        while self._watchers > 0 and not self.draining:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self._poll)
            if self._watchers == 0 or self.draining:
                break
            announced = self._changed.is_set()
            since = time.monotonic() - last_read
            due = since >= self._recheck and self._unannounced_changes()
            if not (announced or self._reports_fingerprint() != self._reports_seen or due or self._stale_due()):
                continue
            if not announced and since < READ_SHARE_GAP * self._read_seconds:
                # Reports keep changing in a busy fleet: re-read at most a READ_SHARE of the time. An
                # announced change (a rollback) is never held back.
                continue
            await asyncio.sleep(self._debounce)  # a burst of changes: one read
            if self._watchers == 0 or self.draining:
                break  # the last page closed meanwhile: nobody needs the read
            self._changed.clear()
            self._reports_seen = self._reports_fingerprint()
            last_read = time.monotonic()
            try:
                await self._read()
            except Exception as exc:  # why: a database hiccup; pages keep what they have, the next change retries
                event(log, "ui.summary_failed", logging.WARNING, error=str(exc))


def _label(summary: Summary, digest: str) -> str:
    names = summary.labels.get(digest)
    return ",".join(names) if names else digest.removeprefix("sha256:")[:12]
