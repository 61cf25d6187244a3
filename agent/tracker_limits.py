"""What bounds the work one node makes the tracker do: a request rate per node, cached misses, checked addresses.

- **Rate per node.** Each node (the ticket's node, checked first) has a token bucket of
  ``burst`` requests refilled at ``rate`` per second; past it the tracker answers 429 with
  ``Retry-After`` (``TrackerBusy``) and does nothing else. A node's honest traffic (one sources
  call per chunk, an availability read every ``availability_ttl``, announcements) stays far below.
- **Misses are cached.** A version the cache does not know makes it re-read the pointers from the
  control plane once; then the miss is remembered for ``MISS_SECONDS`` (``MissCache``), and
  concurrent requests for it wait on that one read (single flight), so a node asking about a
  version no pointer names costs the control plane one read, not one per request.
- **Announced addresses** (``check_announced``): never link-local or metadata, inside the
  cluster's networks when configured (``weightship.addresses``), and the address the node
  registered when its ticket names one (``Ticket.addr``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from weightship.addresses import Network, check_peer_address
from weightship.errors import ForbiddenError, NotFoundError, TemporaryError
from weightship.manifest import Manifest
from weightship.tickets import Ticket

__all__ = ["MISS_SECONDS", "REQUEST_BURST", "REQUEST_RATE", "MissCache", "RequestRate", "TrackerBusy", "check_announced"]

#: tracker requests per second one node may make, sustained
REQUEST_RATE = 100.0
#: requests one node may make at once before the rate applies
REQUEST_BURST = 200.0
#: how long a version the cache did not know is answered 404 without asking the control plane again
MISS_SECONDS = 5.0
#: nodes (or versions) remembered at most; all are forgotten at once past it
_MAX_KEYS = 10_000

class TrackerBusy(TemporaryError):
    """A node asked the tracker more often than its rate allows (429)."""

    status_code = 429
    code = "tracker_rate_limited"


class RequestRate:
    """A token bucket per node."""

    def __init__(
        self, rate: float = REQUEST_RATE, burst: float = REQUEST_BURST, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.refused = 0
        self._buckets: dict[str, tuple[float, float]] = {}

    def admit(self, node: str) -> None:
        """Take one request from ``node``'s bucket; ``TrackerBusy`` when it is empty."""
        now = self.clock()
        tokens, at = self._buckets.get(node, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self.refused += 1
            self._buckets[node] = (tokens, now)
            raise TrackerBusy(
                f"node {node!r} asks the tracker more than {self.rate:g} times a second; slow down",
                delay=max(0.1, (1.0 - tokens) / self.rate),
            )
        if len(self._buckets) >= _MAX_KEYS and node not in self._buckets:
            self._buckets.clear()
        self._buckets[node] = (tokens - 1.0, now)


class MissCache:
    """Versions the cache did not know, remembered for ``seconds``; one lookup at a time per version."""

    def __init__(self, seconds: float = MISS_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        #: lookups that reached the manifests' source (the cache, then the control plane)
        self.lookups = 0
        self._missing: dict[str, tuple[float, NotFoundError]] = {}
        self._flights: dict[str, asyncio.Future[Manifest]] = {}

    async def lookup(self, version: str, find: Callable[[str], Awaitable[Manifest]]) -> Manifest:
        """``find(version)``, unless it missed less than ``seconds`` ago (the same 404 again) or is running now."""
        missed = self._missing.get(version)
        if missed is not None:
            if self.clock() < missed[0]:
                raise missed[1]
            del self._missing[version]
        flight = self._flights.get(version)
        if flight is None:
            flight = asyncio.ensure_future(self._find(version, find))
            self._flights[version] = flight
            flight.add_done_callback(lambda _f: self._flights.pop(version, None))
        return await asyncio.shield(flight)

    async def _find(self, version: str, find: Callable[[str], Awaitable[Manifest]]) -> Manifest:
        self.lookups += 1
        try:
            return await find(version)
        except NotFoundError as exc:
            if len(self._missing) >= _MAX_KEYS:
                self._missing.clear()
            self._missing[version] = (self.clock() + self.seconds, exc)
            raise


def check_announced(address: str, ticket: Ticket, networks: Sequence[Network] = ()) -> None:
    """Refuse (400/403) an announced peer address the announcing node may not use (see the module doc)."""
    check_peer_address(address, networks, what=f"node {ticket.node!r}: announced address")
    if ticket.addr is not None and address.rstrip("/") != ticket.addr.rstrip("/"):
        raise ForbiddenError(
            f"node {ticket.node!r} announced {address!r} but registered {ticket.addr!r}; a node announces only "
            "the peer address it registered (--peer-address)",
            code="address_not_registered",
        )
