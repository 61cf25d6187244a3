"""Where a node gets a chunk, nearest first: local → peers (via the tracker) → cluster cache → region cache → origin.

``Fetcher`` reads local copies itself and asks ``Sources.attempts`` for the network tiers in
between; only when every one of them failed does it go to the origin on its blob URLs. Whatever
the source, the fetcher hashes the bytes against the manifest before they are written or served
(``Staging.place``); here a mismatch is reported to the tracker as ``corrupt`` and that parent is
avoided (by this node at once, by the cluster after a quorum of reporters).

Peers: the tracker (in the cluster cache) answers with ranked parents, or grants this node the
right to go up a tier, or says wait. A chunk the node is told to wait for is ``Deferred``: the
fetcher puts it back for ``retry_after`` and takes another chunk meanwhile; once a chunk has been
deferred for ``wait_limit`` seconds (the tracker's upstream lease: by then a grant held by a node
that died has expired) the node goes up anyway: liveness beats the bound. Which chunk to take next comes from the tracker's
``availability`` of the version (``agent.chunkorder.rank_chunks``: rarest first), read at most every
``availability_ttl`` seconds. A parent slower than ``peer_min_rate`` (bytes/s, after a
``slow_floor`` second allowance) is cut off and reported ``slow``; a 429/503 is ``refused``. A
tracker that does not answer is skipped (the node falls back up the tiers). When a round of tiers
ends with a source that was only busy (429/503), the node waits and asks again, up to
``busy_limit`` seconds, before it goes to the origin: a busy cache will serve soon, and escalating
every refused chunk to the origin is what turns one origin copy per cluster into several.

Hung sources: a peer or cache that lets a read time out without sending a byte (for a cache:
any timeout) is marked down for ``down_backoff`` seconds, doubling while it keeps failing, up to
``down_backoff_max``; every other read waiting on it is cut off at once, and chunks skip it until
the backoff ends, so a frozen cache costs a node about one timeout, not one per chunk. The
tracker is skipped the same way after one failed request (``TRACKER_RETRY_SECONDS``, doubling up
to ``TRACKER_RETRY_MAX``). A source that delivers again is trusted again at once.

Announcements: every verified chunk (from any source) is added to the node's have-set and sent,
batched, ``announce_debounce`` seconds later; the whole set is re-sent every
``announce_interval`` so a restarted tracker rebuilds its state.

Per-source bytes, chunks and errors go to the heartbeat (``NodeCounters.sources``) and the peer
listener's ``/metrics`` (``weightship_fetch_source_*``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from agent.chunkorder import Availability, bitmap_of, chunk_order
from agent.problems import answer_error, status_error
from agent.rangeclient import HttpAnswer, RangeClient
from agent.tickets import Audiences
from weightship.errors import ForbiddenError, IntegrityError, TemporaryError, WeightshipError
from weightship.logs import event
from weightship.manifest import Manifest
from weightship.schemas import SourceTally, TrackerAnnounce, TrackerAvailability, TrackerHave, TrackerSources

__all__ = ["SOURCES", "Attempt", "Deferred", "SourceCounters", "Sources", "Want", "reason_of"]

log = logging.getLogger("agent.sources")

#: after a tracker failed to answer, chunks skip it for this long (doubling while it keeps failing)
TRACKER_RETRY_SECONDS = 5.0
TRACKER_RETRY_MAX = 60.0

#: every source a chunk can come from, nearest first
SOURCES = ("local", "peer", "cluster_cache", "region_cache", "origin")


class SourceCounters:
    """Bytes, chunks and errors per source; safe to bump from worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tally: dict[str, list[int]] = {name: [0, 0, 0] for name in SOURCES}

    def delivered(self, source: str, nbytes: int) -> None:
        """One verified chunk of ``nbytes`` came from ``source``."""
        with self._lock:
            t = self._tally[source]
            t[0] += nbytes
            t[1] += 1

    def failed(self, source: str) -> None:
        """One attempt at ``source`` failed (refused, slow, corrupt, unreachable)."""
        with self._lock:
            self._tally[source][2] += 1

    def snapshot(self) -> dict[str, SourceTally]:
        """The tallies, as the heartbeat schema."""
        with self._lock:
            return {k: SourceTally(bytes=b, chunks=c, errors=e) for k, (b, c, e) in self._tally.items()}

    def metrics(self) -> str:
        """Prometheus text lines."""
        lines = []
        for name, tally in self.snapshot().items():
            lines.append(f'weightship_fetch_source_bytes_total{{source="{name}"}} {tally.bytes}')
            lines.append(f'weightship_fetch_source_chunks_total{{source="{name}"}} {tally.chunks}')
            lines.append(f'weightship_fetch_source_errors_total{{source="{name}"}} {tally.errors}')
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Want:
    """The chunk a fetcher wants: version, digest, and where it lies in the origin's blob."""

    version: str
    chunk: str
    blob: str
    index: int
    length: int


@dataclass
class Attempt:
    """One source to try for a chunk; ``bad`` tells the tracker (for a peer) what went wrong."""

    source: str
    url: str
    timeout: float
    parent: str = ""
    bad: Callable[[str], Awaitable[None]] = field(default=lambda _reason: _nothing())


async def _nothing() -> None:
    return None


class Sources:
    """The network tiers between local copies and the origin, and the announcements."""

    def __init__(
        self,
        *,
        node: str,
        address: str,
        labels: dict[str, str],
        tickets: Callable[..., Awaitable[str]],
        tracker: str = "",
        cluster_cache: str = "",
        region_cache: str = "",
        counters: SourceCounters | None = None,
        upload_slots: int = 4,
        concurrency: int = 4,
        peer_min_rate: float = 5e6,
        slow_floor: float = 2.0,
        wait_limit: float = 30.0,
        busy_limit: float = 30.0,
        announce_interval: float = 10.0,
        announce_debounce: float = 0.02,
        availability_ttl: float = 0.1,
        down_backoff: float = 30.0,
        down_backoff_max: float = 300.0,
        client: RangeClient | None = None,
    ) -> None:
        self.node = node
        self.client = client or RangeClient()
        self._own_client = client is None
        self.address = address
        self.labels = labels
        #: ``tickets(versions)`` or ``tickets(versions, audience)``: a ticket naming the node it is sent to
        self.tickets = tickets
        self.audiences = Audiences()
        self.tracker = tracker.rstrip("/")
        self.caches = [
            (n, u.rstrip("/")) for n, u in (("cluster_cache", cluster_cache), ("region_cache", region_cache)) if u
        ]
        self.counters = counters or SourceCounters()
        self.upload_slots = upload_slots
        self.concurrency = concurrency
        self.peer_min_rate = peer_min_rate
        self.slow_floor = slow_floor
        self.wait_limit = wait_limit
        self.busy_limit = busy_limit
        self.announce_interval = announce_interval
        self.announce_debounce = announce_debounce
        self.availability_ttl = availability_ttl
        self._seen: dict[str, tuple[float, Availability | None]] = {}
        self._seen_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._held: dict[str, tuple[dict[str, int], set[int]]] = {}
        self._dirty = asyncio.Event()
        self._last_ok = True
        #: versions the control plane refused a ticket for, already logged (they are left out of announcements)
        self._refused_logged: set[str] = set()
        self._tracker_down_until = 0.0
        self._tracker_backoff = 0.0
        self.down_backoff = down_backoff
        self.down_backoff_max = down_backoff_max
        #: source base URL -> (down until, last backoff)
        self._down: dict[str, tuple[float, float]] = {}
        #: source base URL -> deadlines of the reads waiting on it now
        self._waiting: dict[str, set[asyncio.Timeout]] = {}

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
        await self.audiences.close()
        if self._own_client:
            await self.client.close()

    # --- choosing ------------------------------------------------------------------------------

    async def attempts(self, want: Want, defer: bool = False) -> AsyncGenerator[Attempt]:
        """The tiers to try for ``want``, nearest first (the origin is the fetcher's own last resort).

        With ``defer``, a tracker that says "wait" raises ``Deferred`` (take another chunk first);
        without, the node goes up the tiers at once.
        """
        query = f"?version={want.version}&blob={want.blob}&index={want.index}"
        timeout = self.slow_floor + want.length / self.peer_min_rate
        if self.tracker and asyncio.get_running_loop().time() >= self._tracker_down_until and not self.is_down(self.tracker):
            advice = await self._advice(want)
            if defer and advice is not None and not advice.sources and not advice.upstream_allowed:
                raise Deferred(advice.retry_after or 0.2)
            for source in advice.sources if advice is not None else ():
                if self.is_down(source.address):
                    continue
                yield Attempt(
                    "peer",
                    f"{source.address.rstrip('/')}/v1/chunks/{want.chunk}{query}",
                    timeout,
                    source.node,
                    self._reporter(want, source.node),
                )
        for name, base in self.caches:
            if not self.is_down(base):
                yield Attempt(name, f"{base}/v1/chunks/{want.chunk}{query}", timeout * 4)

    def is_down(self, url: str) -> bool:
        """Whether the source at ``url`` (its scheme, host and port) is marked down now."""
        until, _backoff = self._down.get(_base(url), (0.0, 0.0))
        return asyncio.get_running_loop().time() < until

    def _mark_down(self, base: str, who: str) -> None:
        """``base`` stopped answering: skip it for a backoff period and cut off every read waiting on it."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        until, backoff = self._down.get(base, (0.0, 0.0))
        if now < until:
            return  # already down (another read saw it first)
        backoff = min(self.down_backoff_max, backoff * 2) if backoff else self.down_backoff
        self._down[base] = (now + backoff, backoff)
        waiting = self._waiting.get(base, set())
        event(log, "sources.source_down", logging.WARNING, source=who, retry_in=backoff, cut_off=len(waiting))
        for deadline in waiting:
            if not deadline.expired():  # one that fired already is on its way out
                deadline.reschedule(now)

    def _tracker_failed(self, error: BaseException) -> float:
        """The tracker did not answer: skip it for a while, longer each time in a row; returns how long.

        A timeout marks its listener down too (the cluster cache's, which then is not asked for chunks either).
        """
        loop = asyncio.get_running_loop()
        if isinstance(error, TimeoutError):
            self._mark_down(_base(self.tracker), f"tracker {self.tracker}")
        if loop.time() < self._tracker_down_until:
            return self._tracker_backoff  # concurrent requests that failed together count once
        self._tracker_backoff = min(TRACKER_RETRY_MAX, self._tracker_backoff * 2) if self._tracker_backoff else TRACKER_RETRY_SECONDS
        self._tracker_down_until = loop.time() + self._tracker_backoff
        return self._tracker_backoff

    async def _advice(self, want: Want) -> TrackerSources | None:
        loop = asyncio.get_running_loop()
        try:
            query = f"sources?version={want.version}&chunk={want.chunk}"
            advice = TrackerSources.model_validate_json(await self._tracker_get(query, want.version))
        except (aiohttp.ClientError, TimeoutError, WeightshipError, ValueError) as exc:
            # Skip it for a while rather than time out on every chunk; the caches still serve.
            down = loop.time() < self._tracker_down_until
            retry_in = self._tracker_failed(exc)
            if not down:
                event(log, "sources.tracker_unavailable", logging.WARNING, tracker=self.tracker, error=str(exc),
                      retry_in=retry_in)  # fmt: skip
            return None
        self._tracker_backoff = 0.0
        return advice

    async def _tracker_get(self, query: str, version: str) -> bytes:
        """The body of ``GET <tracker>/v1/tracker/<query>`` with a ticket for ``version``; non-200 is temporary."""
        http = await self._http()
        headers = {"Authorization": f"Ticket {await self._ticket_to([version], base=self.tracker)}"}
        url = f"{self.tracker}/v1/tracker/{query}"
        async with http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as response:
            if response.status != 200:
                raise await answer_error(response, f"tracker {self.tracker}: GET /v1/tracker/{query}")
            return await response.read()

    async def availability(self, version: str) -> Availability | None:
        """The tracker's view of ``version``'s chunks (cached ``availability_ttl``); None without one."""
        loop = asyncio.get_running_loop()
        if not self.tracker or loop.time() < self._tracker_down_until or self.is_down(self.tracker):
            return None
        async with self._seen_lock:  # one request at a time: every free slot of this node wants it
            at, seen = self._seen.get(version, (float("-inf"), None))
            if loop.time() - at < self.availability_ttl:
                return seen
            try:
                doc = TrackerAvailability.model_validate_json(
                    await self._tracker_get(f"availability?version={version}", version)
                )
                seen = Availability(tuple(doc.holders), frozenset(doc.fetching), frozenset(doc.cached),
                                    doc.upstream_free, tuple(doc.free))  # fmt: skip
            except (aiohttp.ClientError, TimeoutError, WeightshipError, ValueError) as exc:
                # Without it the node keeps its own shuffled order; the sources calls skip the tracker too.
                retry_in = self._tracker_failed(exc)
                event(log, "sources.availability_unavailable", logging.WARNING, tracker=self.tracker,
                      error=str(exc), retry_in=retry_in)  # fmt: skip
                self._seen[version] = (loop.time() + retry_in - self.availability_ttl, None)
                return None
            self._seen[version] = (loop.time(), seen)
            return seen

    def _reporter(self, want: Want, parent: str) -> Callable[[str], Awaitable[None]]:
        async def report(reason: str) -> None:
            await self._report(want, parent, reason)

        return report

    async def _report(self, want: Want, parent: str, reason: str) -> None:
        event(log, "sources.parent_reported", logging.WARNING, parent=parent, reason=reason, chunk=want.chunk)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, WeightshipError):
            http = await self._http()
            headers = {"Authorization": f"Ticket {await self._ticket_to([want.version], base=self.tracker)}"}
            body = {"node": parent, "version": want.version, "chunk": want.chunk, "reason": reason}
            async with http.post(f"{self.tracker}/v1/tracker/report", json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=5)):  # fmt: skip
                pass

    async def _ticket_to(self, versions: list[str], parent: str = "", base: str = "") -> str:
        """A ticket for ``versions`` bound to where it is sent: peer ``parent``, or the listener at ``base``.

        Bound to its audience, a ticket a hostile peer harvests opens nothing at another peer or cache.
        """
        # A listener marked down is not asked who it is (that would wait out another timeout).
        audience = parent or (await self.audiences.name_of(base) if base and not self.is_down(base) else None)
        if audience is None:
            return await self.tickets(versions)
        return await self.tickets(versions, audience)

    # --- reading -------------------------------------------------------------------------------

    async def read(self, attempt: Attempt, want: Want, into: memoryview) -> None:
        """Fill ``into`` from ``attempt`` (unverified: the caller hashes it); errors are ours."""
        who = f"{attempt.source} {attempt.parent or attempt.url.split('?', 1)[0]}"
        if self.is_down(attempt.url):
            raise _Down(f"{who} is marked down (it stopped answering); skipped for {want.chunk}")
        listener = attempt.url.split("/v1/chunks/", 1)[0]
        headers = {"Authorization": f"Ticket {await self._ticket_to([want.version], attempt.parent, listener)}"}
        base = _base(attempt.url)
        received = 0

        def count(nbytes: int) -> None:
            nonlocal received
            received += nbytes

        waiting = self._waiting.setdefault(base, set())
        try:
            async with asyncio.timeout(attempt.timeout) as deadline:
                waiting.add(deadline)
                try:
                    await self.client.get(attempt.url, into[: want.length], count, headers)
                finally:
                    waiting.discard(deadline)
        except TimeoutError:
            if self.is_down(base):
                raise _Down(f"{who} is marked down (it stopped answering); cut off for {want.chunk}") from None
            if received == 0 or attempt.source != "peer":
                # Not a byte in a whole timeout (or a cache that timed out): it stopped answering.
                self._mark_down(base, who)
                raise _Down(f"{who} sent nothing for {attempt.timeout:.1f}s for {want.chunk}; marked down") from None
            raise _Slow(f"{who} too slow for {want.chunk}") from None
        except HttpAnswer as answer:
            if answer.status in (429, 503):
                raise _Refused(f"{who} is busy ({answer.status})") from None
            refusal = status_error(answer.status, answer.headers, answer.body, who)
            raise TemporaryError(
                f"{attempt.source} answered {answer.status} for chunk {want.chunk}: {refusal.message}"
            ) from None
        self._down.pop(base, None)  # it answers again

    # --- announcing ----------------------------------------------------------------------------

    def holding(self, manifest: Manifest, chunks: Iterable[str] = ()) -> None:
        """Start announcing ``manifest``'s version, with ``chunks`` already held."""
        if manifest.digest not in self._held:
            self._held[manifest.digest] = ({d: i for i, d in enumerate(chunk_order(manifest))}, set())
        self.verified(manifest, chunks)

    def forget(self, version: str) -> None:
        """``version`` is gone from this node (evicted): the next announcement no longer names it."""
        if self._held.pop(version, None) is not None:
            self._dirty.set()

    def verified(self, manifest: Manifest, chunks: Iterable[str]) -> None:
        """These chunks of ``manifest`` were verified here: announce them soon (without a peer
        listener too: the announcement ends this node's upstream grants for them)."""
        if not self.tracker:
            return
        if manifest.digest not in self._held:
            self.holding(manifest)
        order, have = self._held[manifest.digest]
        have.update(order[c] for c in chunks if c in order)
        self._dirty.set()

    async def announce_loop(self) -> None:
        """Send the have-sets: soon after each change, and all of them every ``announce_interval``."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self.announce_interval)
                await asyncio.sleep(self.announce_debounce)
            changed = self._dirty.is_set()
            self._dirty.clear()
            if self._held and self.tracker:
                ok = await self.announce()
                if ok and (changed or not self._last_ok):
                    # logged on news, and on the first success after failures (a tracker back up)
                    held = sum(len(have) for _order, have in self._held.values())
                    event(log, "sources.announced", versions=len(self._held), chunks=held)
                self._last_ok = ok

    async def _ticket(self, versions: dict[str, TrackerHave]) -> str | None:
        """A ticket for ``versions``, leaving out (in place) those the control plane refuses; None if none is left.

        A node may hold a version it may no longer announce (the canary of an aborted rollout): that
        version is dropped from the announcement, logged once, and the rest is still announced.
        """
        try:
            return await self._ticket_to(sorted(versions), base=self.tracker)
        except ForbiddenError as exc:
            refused = set(str(exc.fields.get("refused") or "").split(",")) & set(versions)
            if not refused:
                raise
            for version in sorted(refused - self._refused_logged):
                event(log, "sources.announce_version_dropped", logging.WARNING, version=version, error=exc.message)
            self._refused_logged |= refused
            for version in refused:
                del versions[version]
            return await self._ticket_to(sorted(versions), base=self.tracker) if versions else None

    async def announce(self) -> bool:
        """One announcement of everything held; False (logged) when it failed: the next one repeats it."""
        versions = {v: TrackerHave(have=base64.b64encode(bitmap_of(have, len(order))).decode())
                    for v, (order, have) in self._held.items()}  # fmt: skip
        try:
            ticket = await self._ticket(versions)
            if ticket is None:
                return True  # nothing held that this node may announce
            body = TrackerAnnounce(node=self.node, address=self.address or None, labels=self.labels,
                                   upload_slots_free=self.upload_slots, versions=versions)  # fmt: skip
            http = await self._http()
            headers = {"Authorization": f"Ticket {ticket}", "Content-Type": "application/json"}
            async with http.post(f"{self.tracker}/v1/tracker/announce", data=body.model_dump_json(),
                                 headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as response:  # fmt: skip
                if response.status == 204:
                    return True
                refusal = await answer_error(response, f"tracker {self.tracker}: announce")
                event(log, "sources.announce_refused", logging.WARNING, status=response.status, code=refusal.code,
                      error=refusal.message)  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, WeightshipError) as exc:
            event(log, "sources.announce_failed", logging.WARNING, tracker=self.tracker, error=str(exc))
        return False


def _base(url: str) -> str:
    """``scheme://host:port`` of ``url``: what a source is known by when it is marked down."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class Deferred(Exception):
    """The tracker says wait for this chunk: the fetcher takes another one first."""

    def __init__(self, delay: float) -> None:
        super().__init__(f"wait {delay}s")
        self.delay = delay


class _Refused(TemporaryError):
    """A source answered 429/503: over its upload concurrency."""


class _Slow(TemporaryError):
    """A source sent too slowly and was cut off."""


class _Down(_Slow):
    """A source stopped answering (marked down): skipped, or cut off when another read saw it first."""


def is_busy(error: WeightshipError) -> bool:
    """The source refused for load (429/503): worth waiting for rather than going up to the origin."""
    return isinstance(error, _Refused)


def reason_of(error: WeightshipError) -> str:
    """The tracker report reason for a failed peer attempt."""
    if isinstance(error, IntegrityError):
        return "corrupt"
    if isinstance(error, _Slow):
        return "slow"
    return "refused"
