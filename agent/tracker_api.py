"""The tracker's HTTP routes, mounted on the cluster cache's peer listener (``PeerServer``).

::

    POST /v1/tracker/announce   TrackerAnnounce  -> 204   ticket's node must be body.node, cover each version
    GET  /v1/tracker/sources?version=&chunk=     -> TrackerSources   ticket covering version
    GET  /v1/tracker/availability?version=       -> TrackerAvailability   ticket covering version
    POST /v1/tracker/report     TrackerReport    -> 204   ticket (reporter = ticket's node)

Everything a node says is checked against its ticket (signed by the control plane, checked
offline): a node can announce only for itself and only versions it is entitled to, so it cannot
advertise chunks on another node's behalf or learn who holds a version it may not fetch. A version
the ticket does not cover (the node still holds a version it may no longer announce, e.g. the
canary of an aborted rollout) is dropped from the announcement, and from what the tracker knew the
node to hold, and logged once per node and version; the rest of the announcement is accepted. Only
an announcement the ticket covers none of is refused. Chunk
numbers are the version's ``chunk_order``; the manifest comes from the cache (which has every
version a pointer names), so a bitmap naming chunks the version does not have is refused, and
one longer than the version's chunk count needs is refused before it is decoded or expanded.
Bodies past ``agent.peerserver.MAX_BODY`` are refused before they are read.
Each node's requests are rate-limited, a version the cache does not know is a cached miss, and an
announced address must be the node's own (``agent.tracker_limits``).
Errors escape the handlers to the peer listener's boundary (``agent.problems``), which answers
them as RFC 9457 problem details.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from aiohttp import web
from pydantic import ValidationError as PydanticValidationError

from agent.chunkorder import chunk_order, indexes_of
from agent.listenerbounds import LogBudget
from agent.tickets import TicketKeeper
from agent.tracker import NodeView, Reason, Tracker
from agent.tracker_limits import MissCache, RequestRate, check_announced
from weightship.addresses import Network
from weightship.errors import ForbiddenError, NotFoundError, ValidationError
from weightship.logs import event
from weightship.manifest import Manifest
from weightship.schemas import TrackerAnnounce, TrackerAvailability, TrackerReport, TrackerSource, TrackerSources
from weightship.tickets import TicketNotCovering

__all__ = ["TrackerRoutes"]

log = logging.getLogger("agent.tracker")

#: dropped (node, version) pairs remembered for logging once; forgotten all at once past this
_MAX_DROPPED_LOGGED = 10_000


class TrackerRoutes:
    """Binds a ``Tracker`` to HTTP, with ticket checks."""

    def __init__(
        self,
        tracker: Tracker,
        tickets: TicketKeeper,
        manifests: Callable[[str], Awaitable[Manifest]],
        cached: Callable[[Manifest], Iterable[int]] = lambda _m: (),
        holds: Callable[[str], bool] = lambda _chunk: False,
        *,
        networks: Sequence[Network] = (),
        rate: RequestRate | None = None,
        misses: MissCache | None = None,
    ) -> None:
        self.tracker = tracker
        #: the cluster's networks announced addresses must lie in (none: any address but link-local/metadata)
        self.networks = tuple(networks)
        self.rate = rate or RequestRate()
        self.log_budget = LogBudget()
        self.misses = misses or MissCache()
        self.tickets = tickets
        self.manifests = manifests
        #: chunk indexes (chunk order) of a version the cache holds; the cache's read-ahead starts here
        self.cached = cached
        #: whether the cache holds one chunk (by digest): what a sources answer needs, in O(1)
        self.holds = holds
        self._orders: dict[str, dict[str, int]] = {}
        #: (node, version) pairs whose dropping was logged already
        self._dropped_logged: set[tuple[str, str]] = set()

    def mount(self, app: web.Application) -> None:
        """Add the routes to ``app`` (``PeerServer(extra_routes=...)``)."""
        app.router.add_post("/v1/tracker/announce", self._announce)
        app.router.add_get("/v1/tracker/sources", self._sources)
        app.router.add_get("/v1/tracker/availability", self._availability)
        app.router.add_post("/v1/tracker/report", self._report)

    async def _order(self, version: str) -> dict[str, int]:
        order = self._orders.get(version)
        if order is None:
            manifest = await self.misses.lookup(version, self.manifests)
            order = {digest: i for i, digest in enumerate(chunk_order(manifest))}
            self._orders[version] = order
        return order

    async def _announce(self, request: web.Request) -> web.Response:
        try:
            body = TrackerAnnounce.model_validate_json(await request.read())
            if not body.versions:
                raise ValidationError("an announcement names at least one version it holds chunks of")
            header = request.headers.get("Authorization")
            held: dict[str, list[int]] = {}
            dropped: list[tuple[str, TicketNotCovering]] = []
            for version, have in body.versions.items():
                try:
                    ticket = await self.tickets.check(header, version)
                except TicketNotCovering as exc:
                    dropped.append((version, exc))
                    continue
                if ticket.node != body.node:
                    raise ForbiddenError(
                        f"ticket names node {ticket.node!r} but the announcement is for {body.node!r}; "
                        "a node announces only for itself"
                    )
                if not held:
                    self.rate.admit(ticket.node)
                    if body.address is not None:
                        check_announced(body.address, ticket, self.networks)
                count = len(await self._order(version))
                held[version] = list(indexes_of(_decode(have.have, count), count))
            if not held:
                raise dropped[0][1]
            for version, refusal in dropped:
                self._dropped(body.node, version, refusal)
            view = NodeView(
                body.node,
                body.address or "",
                rack=body.labels.get("rack", ""),
                zone=body.labels.get("zone", ""),
                upload_slots_free=body.upload_slots_free,
            )
            self.tracker.announce(view, held)
            return web.Response(status=204)
        except PydanticValidationError as exc:
            raise ValidationError(f"announcement: {exc.errors()[0].get('msg', 'invalid')}") from None

    def _dropped(self, node: str, version: str, error: TicketNotCovering) -> None:
        """Forget what ``node`` held of ``version``; log it the first time for this node and version."""
        self.tracker.forget_version(node, version)
        if (node, version) in self._dropped_logged:
            return
        if len(self._dropped_logged) >= _MAX_DROPPED_LOGGED:
            self._dropped_logged.clear()
        self._dropped_logged.add((node, version))
        event(log, "tracker.announce_version_dropped", logging.WARNING, node=node, version=version,
              error=error.message)  # fmt: skip

    async def _sources(self, request: web.Request) -> web.Response:
        version = request.query.get("version", "")
        chunk = request.query.get("chunk", "")
        ticket = await self.tickets.check(request.headers.get("Authorization"), version)
        self.rate.admit(ticket.node)
        index = (await self._order(version)).get(chunk)
        if index is None:
            raise NotFoundError(f"version {version} has no chunk {chunk}")
        advice = self.tracker.sources(ticket.node, version, index, self.holds(chunk))
        answer = TrackerSources(
            sources=[TrackerSource(node=s.node, address=s.address) for s in advice.sources],
            upstream_allowed=advice.upstream_allowed,
            retry_after=advice.retry_after,
        )
        return web.Response(text=answer.model_dump_json(), content_type="application/json")

    async def _availability(self, request: web.Request) -> web.Response:
        version = request.query.get("version", "")
        ticket = await self.tickets.check(request.headers.get("Authorization"), version)
        self.rate.admit(ticket.node)
        order = await self._order(version)  # first: a version no pointer names is a cached miss
        manifest = await self.manifests(version)
        seen = self.tracker.availability(ticket.node, version, len(order), self.cached(manifest))
        answer = TrackerAvailability(
            holders=list(seen.holders),
            fetching=sorted(seen.fetching),
            cached=sorted(seen.cached),
            upstream_free=seen.upstream_free,
            free=list(seen.free),
        )
        return web.Response(text=answer.model_dump_json(), content_type="application/json")

    async def _report(self, request: web.Request) -> web.Response:
        try:
            body = TrackerReport.model_validate_json(await request.read())
            ticket = await self.tickets.check(request.headers.get("Authorization"), body.version)
            self.rate.admit(ticket.node)
            index = (await self._order(body.version)).get(body.chunk)
            if index is None:
                raise NotFoundError(f"version {body.version} has no chunk {body.chunk}")
            self.tracker.report(ticket.node, body.node, body.version, index, Reason(body.reason))
            # one line per reporter every 10 s at most: a node repeating a report cannot flood the cache's log
            self.log_budget.event(log, "tracker.reported", cause=f"reported:{ticket.node}", reporter=ticket.node,
                                  parent=body.node, reason=body.reason, chunk=body.chunk)  # fmt: skip
            return web.Response(status=204)
        except PydanticValidationError as exc:
            raise ValidationError(f"report: {exc.errors()[0].get('msg', 'invalid')}") from None


def _decode(have: str, count: int) -> bytes:
    """The bitmap ``have`` encodes, refused unread when it is longer than ``count`` chunks need."""
    if len(have) > 4 * (((count + 7) // 8 + 2) // 3):
        raise ValidationError(
            f"have-bitmap is {len(have)} base64 characters but the version has {count} chunks; announce with the "
            "version's chunk order (agent.chunkorder.chunk_order)"
        )
    try:
        return base64.b64decode(have, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError("have is not a base64 bitmap over the version's chunk order") from None
