"""The cluster tracker's algorithm: who holds which chunks, and whom a node should fetch from.

Pure and synchronous, with an injectable clock, so the same code runs inside the cluster
cache (``agent.tracker_api`` puts it behind HTTP) and inside ``bench/simulate.py`` (a
discrete-event model drives it with simulated time).

State, all soft (a restarted tracker knows nothing and is rebuilt by re-announcements)::

    nodes:        name -> address, labels (rack, zone), upload slots free, last announce time
    holdings:     version -> name -> set of chunk indexes held (verified by that node)
    assignments:  (parent, child, version, chunk) -> lease expiry   (fan-out accounting)
    upstream:     child -> lease expiry; (version, chunk) -> children fetching it upstream
    penalties:    parent -> until, per reporter and (after a quorum of reporters) for everyone

A node announces, batched, every chunk it holds of every version it is fetching or serving;
while it fetches it announces again as chunks verify, so a chunk is handed onward as soon as
one node in the cluster verified it. A node silent for ``announce_ttl`` is forgotten.

``sources(child, version, chunk)`` ranks the holders that are alive, not the child itself, not
penalised and below their fan-out bound: most spare upload capacity first (what the parent
reported free, minus the children the tracker already sent it), then same rack, then same zone,
then a hash of (child, parent, chunk) so equal parents share the load instead of the first in
the list taking it all. The first source is charged to that parent's fan-out until the child
announces the chunk, reports the parent, or the lease runs out.

Upstream admission: a node may go up a tier (cluster cache and beyond) for a chunk only when
no peer can serve it, fewer than ``upstream_per_chunk`` nodes are already fetching that chunk
upstream, fewer than ``upstream_slots`` chunk fetches are granted cluster-wide, and the node holds
fewer than ``upstream_per_node`` grants (so one node, however often it asks, leaves the rest of
the slots to others). A grant lasts ``upstream_lease`` from when it was given: asking again
keeps it but does not renew it, so a node that asks and never fetches loses it. A node refused
because every slot is taken joins a queue; a freed slot goes to the nodes queued first (first in,
first out), not to whoever asks next. The one exception to "no peer
can serve it": a chunk the cluster cache holds whose peers are all busy, while fewer than half the
grants are taken (the cache is then one more parent). Few chunks in flight through the caches
at once means each arrives at full speed and peers start spreading it early, instead of every
chunk crawling in at once (``bench/simulate.py`` shows the difference). Anyone else is
told to wait ``retry_after`` and ask again: the chunk will come from a peer that fetched it.

Reports: a child that got corrupt, slow or refused service from a parent reports it. The
reporter avoids that parent at once, for ``penalty[reason]`` (repeating the report renews that,
never lengthens it). "refused" (the parent was busy) is not a strike: only the reporter steps
aside for a moment. "corrupt" and "slow" are strikes, counted once per distinct reporter and
weighed by the reporter's reputation: a reporter that accuses more than ``credible_accusations``
parents at once has its weight spread over them, and a reporter that is itself avoided by
everyone weighs nothing. Everyone avoids the parent once the weight of the reporters against it
reaches ``report_quorum`` (one lying node cannot black-list a healthy parent, however often it
reports), for ``penalty[reason] * 2**(reporters-1)``, at most ``max_penalty``: the ban grows only
with independent evidence, and expires.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from agent.chunkorder import Availability
from weightship.errors import ValidationError

__all__ = [
    "Advice",
    "NodeView",
    "Reason",
    "Source",
    "Tracker",
    "TrackerSettings",
]


class Reason(StrEnum):
    """Why a child reports a parent."""

    corrupt = "corrupt"
    slow = "slow"
    refused = "refused"


@dataclass(frozen=True)
class TrackerSettings:
    """The tracker's knobs (``docs/distribution.md``, "Tracker")."""

    #: a node not heard from for this long is forgotten (a few announce intervals)
    announce_ttl: float = 30.0
    #: most children one parent is sent to at once, whatever it claims free
    fanout: int = 4
    #: how long a handed-out parent counts against its fan-out without news from the child
    lease_seconds: float = 15.0
    #: most sources in one answer (the first is the pick, the rest fallbacks)
    max_sources: int = 3
    #: most chunk fetches from the tier above at once, cluster-wide (so at most that many nodes)
    upstream_slots: int = 8
    #: most nodes fetching one chunk from the tier above at once
    upstream_per_chunk: int = 1
    #: most upstream grants one node holds at once (a node fetches ``--peer-concurrency`` chunks at once, 4 by default)
    upstream_per_node: int = 4
    #: how long an upstream grant lasts unless the node announces the chunk first (asking again does not renew it)
    upstream_lease: float = 30.0
    #: a queued node that has not asked again for this long leaves the queue
    queue_ttl: float = 2.0
    #: what a node told to wait should wait before asking again
    retry_after: float = 0.1
    #: weight of distinct reporters after which a parent is avoided by everyone
    report_quorum: int = 2
    #: parents one reporter may accuse at once at full weight; beyond, its weight is spread over them
    credible_accusations: int = 2
    penalty_corrupt: float = 300.0
    penalty_slow: float = 30.0
    penalty_refused: float = 5.0
    max_penalty: float = 3600.0

    def __post_init__(self) -> None:
        if min(self.fanout, self.max_sources, self.upstream_slots, self.upstream_per_chunk, self.upstream_per_node,
               self.report_quorum, self.credible_accusations) < 1:  # fmt: skip
            raise ValidationError(
                "tracker fanout, max_sources, upstream_slots, upstream_per_chunk, upstream_per_node, report_quorum "
                "and credible_accusations must be ≥ 1"
            )
        if min(self.announce_ttl, self.lease_seconds, self.upstream_lease, self.retry_after, self.queue_ttl) <= 0:
            raise ValidationError("tracker durations must be positive")

    def penalty(self, reason: Reason) -> float:
        """Base avoidance time for one strike of ``reason``."""
        return {Reason.corrupt: self.penalty_corrupt, Reason.slow: self.penalty_slow}.get(reason, self.penalty_refused)


@dataclass(frozen=True)
class NodeView:
    """What a node announced about itself."""

    name: str
    address: str
    rack: str = ""
    zone: str = ""
    upload_slots_free: int = 0


@dataclass(frozen=True)
class Source:
    """A parent handed to a child."""

    node: str
    address: str


@dataclass(frozen=True)
class Advice:
    """The answer to "where do I get this chunk": ranked parents, and whether to go upstream."""

    sources: tuple[Source, ...]
    upstream_allowed: bool
    #: with no sources and no upstream grant: ask again after this many seconds
    retry_after: float = 0.0


@dataclass
class _Node:
    view: NodeView
    seen: float


@dataclass
class _Penalty:
    reporters: dict[str, float] = field(default_factory=dict)  # reporter -> until (its own avoidance)
    strikes: dict[str, tuple[Reason, float]] = field(default_factory=dict)  # reporter -> (reason, until)
    until: float = 0.0  # for everyone, once the reporters' weight reached the quorum


Chunk = tuple[str, int]  # (version digest, chunk index)


class Tracker:
    """One cluster's tracker; each call costs O(holders of one chunk), or O(chunks announced).

    Leases and silent nodes are swept at most every ``sweep_interval`` seconds of the clock, so
    a lease may outlive its nominal length by that much.
    """

    def __init__(
        self,
        settings: TrackerSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        sweep_interval: float = 1.0,
    ) -> None:
        self.settings = settings or TrackerSettings()
        self.clock = clock
        self.sweep_interval = sweep_interval
        self._next_sweep = 0.0
        self._nodes: dict[str, _Node] = {}
        self._holders: dict[Chunk, set[str]] = {}
        self._held: dict[str, dict[str, set[int]]] = {}  # node -> version -> indexes
        self._assigned: dict[tuple[str, Chunk], tuple[str, float]] = {}  # (child, chunk) -> (parent, until)
        self._load: dict[str, int] = {}  # parent -> live assignments
        self._upstream: dict[str, set[Chunk]] = {}  # child -> chunks it fetches upstream
        self._upstream_chunk: dict[Chunk, dict[str, float]] = {}  # chunk -> child -> until
        self._grants = 0  # sum of len(v) over _upstream_chunk
        self._queue: dict[str, float] = {}  # node refused for want of a slot -> last asked (insertion order: FIFO)
        self._penalties: dict[str, _Penalty] = {}
        self._accused: dict[str, set[str]] = {}  # reporter -> parents it holds a live strike against

    # --- announcements -------------------------------------------------------------------------

    def announce(self, view: NodeView, versions: Mapping[str, Iterable[int]]) -> None:
        """Record what ``view.name`` holds now; replaces what it said before for these versions.

        A node without an address serves no peers: what it holds only ends its own grants.
        """
        self._sweep()
        if not view.address:
            for version, indexes in versions.items():
                for index in indexes:
                    self._finished(view.name, (version, index))
            return
        self._nodes[view.name] = _Node(view, self.clock())
        mine = self._held.setdefault(view.name, {})
        for version, indexes in versions.items():
            new = set(indexes)
            old = mine.get(version, set())
            for index in old - new:
                self._drop_holder((version, index), view.name)
            mine[version] = new
            for index in new - old:
                self._holders.setdefault((version, index), set()).add(view.name)
                self._finished(view.name, (version, index))

    def announce_chunks(self, view: NodeView, version: str, indexes: Iterable[int]) -> None:
        """Add chunks ``view.name`` just verified (an incremental announcement)."""
        if not view.address:
            self.announce(view, {version: indexes})
            return
        self._sweep()
        self._nodes[view.name] = _Node(view, self.clock())
        mine = self._held.setdefault(view.name, {}).setdefault(version, set())
        for index in indexes:
            if index not in mine:
                mine.add(index)
                self._holders.setdefault((version, index), set()).add(view.name)
                self._finished(view.name, (version, index))

    def forget_version(self, name: str, version: str) -> None:
        """Drop what ``name`` held of ``version`` (it may no longer announce it); the rest stays."""
        for index in self._held.get(name, {}).pop(version, set()):
            self._drop_holder((version, index), name)

    def forget(self, name: str) -> None:
        """Drop a node and everything it held (it left, or fell silent)."""
        self._nodes.pop(name, None)
        for version, indexes in self._held.pop(name, {}).items():
            for index in indexes:
                self._drop_holder((version, index), name)
        for key in [k for k, (parent, _t) in self._assigned.items() if name in (k[0], parent)]:
            self._release(key)
        for chunk in list(self._upstream.get(name, ())):
            self._drop_upstream(chunk, name)

    def holders(self, version: str, index: int) -> set[str]:
        """Live nodes holding chunk ``index`` of ``version``."""
        self._sweep()
        return set(self._holders.get((version, index), ()))

    def node_count(self) -> int:
        """Live nodes."""
        self._sweep()
        return len(self._nodes)

    # --- choosing sources ----------------------------------------------------------------------

    def sources(self, child: str, version: str, index: int, cached: bool = False) -> Advice:
        """Ranked parents for chunk ``index`` of ``version``, and whether ``child`` may go upstream.

        ``cached``: the cluster cache holds the chunk, so when every peer holding it is busy the
        cache may serve it as one more parent, with at most half the upstream grants (the other
        half stays free for chunks only the cache has).
        """
        self._sweep()
        now = self.clock()
        s = self.settings
        key = (version, index)
        node = self._nodes.get(child)
        me = node.view if node is not None else NodeView(child, "")
        ranked: list[tuple[tuple[int, int, int, bytes], NodeView]] = []
        busy = False
        for name in self._holders.get(key, ()):
            if name == child or self._avoided(name, child, now):
                continue
            parent = self._nodes[name].view
            spare = self._spare(name)
            if spare <= 0:
                busy = True
                continue
            ranked.append(
                (
                    (
                        -spare,
                        0 if me.rack and parent.rack == me.rack else 1,
                        0 if me.zone and parent.zone == me.zone else 1,
                        hashlib.blake2b(f"{child}/{name}/{index}".encode(), digest_size=8).digest(),
                    ),
                    parent,
                )
            )
        ranked.sort(key=lambda item: item[0])
        picked = tuple(Source(v.name, v.address) for _k, v in ranked[: s.max_sources])
        if picked:
            self._release((child, key))
            self._assigned[(child, key)] = (picked[0].node, now + s.lease_seconds)
            self._load[picked[0].node] = self._load.get(picked[0].node, 0) + 1
            return Advice(picked, upstream_allowed=False)
        if busy:
            # Peers hold it and are only at their fan-out bound: one frees within a chunk's time, and
            # the caches' links (the scarcest in the cluster) are kept for chunks no peer has, unless
            # the cache holds this one and has grants to spare (its link idles once a version is in).
            if cached and self._cache_spare() and self._admit_upstream(child, key, now):
                return Advice((), upstream_allowed=True)
            return Advice((), upstream_allowed=False, retry_after=s.retry_after)
        if self._admit_upstream(child, key, now):
            return Advice((), upstream_allowed=True)
        return Advice((), upstream_allowed=False, retry_after=s.retry_after)

    def _admit_upstream(self, child: str, key: Chunk, now: float) -> bool:
        s = self.settings
        fetching = self._upstream_chunk.get(key, {})
        if child in fetching:
            return True  # still granted; asking again does not renew the lease
        if len(fetching) >= s.upstream_per_chunk:
            return False
        if len(self._upstream.get(child, ())) >= s.upstream_per_node:
            return False  # its share is taken: the other slots are for other nodes
        if s.upstream_slots - self._grants <= self._queued_ahead(child, now):
            self._queue[child] = now  # keeps its place when already queued
            return False
        self._queue.pop(child, None)
        self._grants += 1
        self._upstream.setdefault(child, set()).add(key)
        self._upstream_chunk.setdefault(key, {})[child] = now + s.upstream_lease
        return True

    def _queued_ahead(self, child: str, now: float) -> int:
        """Nodes queued for a slot before ``child`` (all queued nodes when it is not queued) that may still take one."""
        s = self.settings
        ahead = 0
        for name, asked in self._queue.items():
            if name == child:
                break
            if now - asked <= s.queue_ttl and len(self._upstream.get(name, ())) < s.upstream_per_node:
                ahead += 1
        return ahead

    def _cache_spare(self) -> bool:
        """Whether the cache may serve a chunk peers hold too: fewer than half the upstream grants are taken."""
        return self._grants < self.settings.upstream_slots // 2

    def availability(self, child: str, version: str, count: int, cached: Iterable[int] = ()) -> Availability:
        """Holders per chunk of ``version`` (``count`` chunks) as ``child`` sees them, for ``agent.chunkorder.rank_chunks``.

        ``cached``: the chunk indexes the cluster cache holds. Costs O(chunks held by live nodes of
        that version); a node asks a few times a second while it fetches.
        """
        self._sweep()
        now = self.clock()
        holders = [0] * count
        spare = [0] * count
        for name, versions in self._held.items():
            if name == child or self._avoided(name, child, now):
                continue
            slots = self._spare(name) > 0
            for index in versions.get(version, ()):
                if 0 <= index < count:
                    holders[index] += 1
                    spare[index] += slots
        fetching = frozenset(i for (v, i) in self._upstream_chunk if v == version)
        s = self.settings
        free = max(0, min(s.upstream_slots - self._grants - self._queued_ahead(child, now),
                          s.upstream_per_node - len(self._upstream.get(child, ()))))  # fmt: skip
        held_here = frozenset(cached)
        if self._cache_spare():
            for index in held_here:
                if 0 <= index < count and holders[index] > 0 and index not in fetching:
                    spare[index] += 1  # the cache as one more parent (``sources``)
        return Availability(tuple(holders), fetching, held_here, free, tuple(spare))

    def _spare(self, parent: str) -> int:
        """Children ``parent`` may still be sent now (its claimed free slots, at most ``fanout``, less its load)."""
        view = self._nodes[parent].view
        return min(view.upload_slots_free, self.settings.fanout) - self._load.get(parent, 0)

    def upstream_count(self) -> int:
        """Nodes holding an upstream grant now."""
        self._sweep()
        return len(self._upstream)

    def upstream_grants(self) -> int:
        """Chunk fetches from the tier above granted and not yet announced or expired."""
        self._sweep()
        return self._grants

    def load(self, parent: str) -> int:
        """Children currently charged to ``parent``."""
        self._sweep()
        return self._load.get(parent, 0)

    # --- reports -------------------------------------------------------------------------------

    def report(self, reporter: str, parent: str, version: str, index: int, reason: Reason) -> None:
        """``reporter`` got bad service from ``parent`` for a chunk: it avoids ``parent`` for a while, everyone on enough evidence."""
        now = self.clock()
        s = self.settings
        if reporter == parent:
            return
        penalty = self._penalties.setdefault(parent, _Penalty())
        self._expire(parent, penalty, now)
        penalty.reporters[reporter] = now + s.penalty(reason)
        if reason is not Reason.refused:
            penalty.strikes[reporter] = (reason, now + s.penalty(reason))
            self._accused.setdefault(reporter, set()).add(parent)
            self._judge(parent, penalty, now)
        assigned = self._assigned.get((reporter, (version, index)))
        if assigned is not None and assigned[0] == parent:
            self._release((reporter, (version, index)))

    def evidence(self, parent: str) -> float:
        """The weight of the distinct reporters with a live strike against ``parent`` (banned at ``report_quorum``)."""
        now = self.clock()
        penalty = self._penalties.get(parent)
        if penalty is None:
            return 0.0
        self._expire(parent, penalty, now)
        return sum(self._weight(r, now) for r in penalty.strikes)

    def _weight(self, reporter: str, now: float) -> float:
        """A reporter's reputation: 0 while everyone avoids it, less the more parents it accuses at once."""
        own = self._penalties.get(reporter)
        if own is not None and own.until > now:
            return 0.0
        accused = len(self._accused.get(reporter, ())) or 1
        return min(1.0, self.settings.credible_accusations / accused)

    def _judge(self, parent: str, penalty: _Penalty, now: float) -> None:
        s = self.settings
        weighed = {r: self._weight(r, now) for r in penalty.strikes}
        if sum(weighed.values()) + 1e-9 < s.report_quorum:
            return
        independent = sum(1 for w in weighed.values() if w > 0)
        base = max(s.penalty(reason) for reason, _until in penalty.strikes.values())
        length = min(s.max_penalty, base * 2 ** (independent - 1))
        penalty.until = max(penalty.until, now + length)

    def _expire(self, parent: str, penalty: _Penalty, now: float) -> None:
        penalty.reporters = {r: t for r, t in penalty.reporters.items() if t > now}
        for reporter in [r for r, (_reason, until) in penalty.strikes.items() if until <= now]:
            del penalty.strikes[reporter]
            accused = self._accused.get(reporter)
            if accused is not None:
                accused.discard(parent)
                if not accused:
                    del self._accused[reporter]

    def avoided(self, parent: str, by: str) -> bool:
        """Whether ``by`` would not be sent to ``parent`` now."""
        return self._avoided(parent, by, self.clock())

    def _avoided(self, parent: str, child: str, now: float) -> bool:
        penalty = self._penalties.get(parent)
        if penalty is None:
            return False
        return penalty.until > now or penalty.reporters.get(child, 0.0) > now

    # --- bookkeeping ---------------------------------------------------------------------------

    def _finished(self, child: str, key: Chunk) -> None:
        """``child`` now holds ``key``: its parent is free again, its upstream grant for it ends."""
        self._release((child, key))
        if key in self._upstream.get(child, ()):
            self._drop_upstream(key, child)

    def _drop_upstream(self, key: Chunk, child: str) -> None:
        fetching = self._upstream_chunk.get(key)
        if fetching is not None:
            if fetching.pop(child, None) is not None:
                self._grants -= 1
            if not fetching:
                del self._upstream_chunk[key]
        mine = self._upstream.get(child)
        if mine is not None:
            mine.discard(key)
            if not mine:
                del self._upstream[child]

    def _release(self, assignment: tuple[str, Chunk]) -> None:
        found = self._assigned.pop(assignment, None)
        if found is not None:
            parent = found[0]
            self._load[parent] -= 1
            if self._load[parent] <= 0:
                del self._load[parent]

    def _drop_holder(self, key: Chunk, name: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(name)
            if not holders:
                del self._holders[key]

    def _sweep(self) -> None:
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_interval
        ttl = self.settings.announce_ttl
        for name in [n for n, node in self._nodes.items() if now - node.seen > ttl]:
            self.forget(name)
        for assignment in [a for a, (_p, until) in self._assigned.items() if until <= now]:
            self._release(assignment)
        for key, fetching in list(self._upstream_chunk.items()):
            for child in [c for c, until in fetching.items() if until <= now]:
                self._drop_upstream(key, child)
        for name in [n for n, asked in self._queue.items() if now - asked > self.settings.queue_ttl]:
            del self._queue[name]
        for parent, penalty in list(self._penalties.items()):
            self._expire(parent, penalty, now)
            if not penalty.reporters and not penalty.strikes and penalty.until <= now:
                del self._penalties[parent]
