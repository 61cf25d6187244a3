"""The agent's calls to the control plane: enrol, register, heartbeat, desired state, blob URLs, manifests, tickets.

Built on the shared HTTP core (``weightship.http.AsyncSession``): the same error mapping as the
CLI (problem details or the older error body, ``Retry-After`` into the ``TemporaryError`` delay),
refused connections and timeouts as ``TemporaryError`` so the daemon's loops back off and retry.
The bearer token is the node's own node token once it has one (``use_token``); ``enrol`` alone
sends the enrolment token it is given. Nothing here retries by itself (``Backoff(attempts=1)``):
the daemon's loops own the backoff, and a long-poll must not be repeated behind their back. The
test seam is the ``transport`` argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from weightship.backoff import Backoff
from weightship.http import AsyncSession, parse, parse_list, segment
from weightship.manifest import check_manifest_bytes
from weightship.schemas import (
    BlobURL,
    BlobURLRequest,
    BlobURLs,
    Deployment,
    DesiredState,
    NodeEnrolment,
    NodeEnrolRequest,
    NodeHeartbeat,
    NodeInfo,
    NodeRegistration,
    TicketGrant,
    TicketKeys,
    TicketRequest,
)
from weightship.signing import VersionSignatures

__all__ = ["ControlPlaneClient"]

#: blobs per URL request (the schema allows 10,000)
_URL_BATCH = 1000
#: a desired-state answer's header: seconds to wait before the next long-poll (the control plane
#: spreads the return of a fleet that one change answered at once)
POLL_AFTER = "Poll-After"
#: the longest ``Poll-After`` obeyed
_MAX_POLL_AFTER = 60.0


class ControlPlaneClient:
    """Typed node-side calls to one control plane."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._session = AsyncSession(
            base_url,
            token,
            service="the control plane",
            advice="check the agent's --control-plane URL and that the control plane is running",
            transport=transport,
            timeout=timeout,
            connect_timeout=5.0,
            backoff=Backoff(attempts=1),
            user_agent="weightship-agent",
        )
        self.base_url = self._session.base_url
        self.timeout = timeout

    async def aclose(self) -> None:
        """Close pooled connections."""
        await self._session.aclose()

    def use_token(self, token: str) -> None:
        """Send ``token`` (the node token) with every call from now on."""
        self._session.token = token or None

    async def enrol(self, request: NodeEnrolRequest, enrolment_token: str) -> NodeEnrolment:
        """Enrol this node with ``enrolment_token``; the answer holds the node token bound to it."""
        response = await self._session.send("POST", "/v1/nodes/enrol", json=request, token=enrolment_token)
        return parse(NodeEnrolment, response)

    async def register(self, registration: NodeRegistration) -> NodeInfo:
        """Re-register this node (same name, same id) with its node token."""
        return parse(NodeInfo, await self._session.send("POST", "/v1/nodes/register", json=registration))

    async def heartbeat(self, node_id: str, heartbeat: NodeHeartbeat) -> None:
        """Report inventory, what is served, counters, health, validation reports and refusals."""
        await self._session.send("POST", f"/v1/nodes/{segment(node_id)}/heartbeat", json=heartbeat)

    async def desired(self, node_id: str, after: str | None, wait: float) -> tuple[DesiredState, float]:
        """The node's desired state, held up to ``wait`` s while it equals ``after``; and seconds to wait before asking again."""
        params: dict[str, str | float] = {"wait": wait}
        if after is not None:
            params["after"] = after
        response = await self._session.send(
            "GET",
            f"/v1/nodes/{segment(node_id)}/desired",
            params=params,
            timeout=self._session.read_timeout(self.timeout + wait),
        )
        return parse(DesiredState, response), _poll_after(response)

    async def blob_urls(self, blobs: Sequence[str]) -> dict[str, BlobURL]:
        """Short-lived range-capable read URLs for ``blobs`` (file sha256 hex), made absolute."""
        found: dict[str, BlobURL] = {}
        for start in range(0, len(blobs), _URL_BATCH):
            body = BlobURLRequest(blobs=list(blobs[start : start + _URL_BATCH]))
            urls = parse(BlobURLs, await self._session.send("POST", "/v1/blobs/urls", json=body))
            for blob, item in urls.urls.items():
                if not item.url.startswith(("http://", "https://")):
                    item = item.model_copy(update={"url": self.base_url + "/" + item.url.lstrip("/")})
                found[blob] = item
        return found

    async def manifest(self, model: str, digest: str) -> bytes:
        """The manifest bytes of ``digest``, checked to hash to ``digest``."""
        path = f"/v1/models/{segment(model)}/versions/{segment(digest)}/manifest"
        raw = (await self._session.send("GET", path)).content
        check_manifest_bytes(raw, digest, "the manifest the control plane sent")
        return raw

    async def signatures(self, model: str, digest: str) -> list[bytes]:
        """Every signature the control plane stores for ``digest`` (checked by the caller, never trusted)."""
        path = f"/v1/models/{segment(model)}/versions/{segment(digest)}/signatures"
        found = parse(VersionSignatures, await self._session.send("GET", path))
        return [s.encode("utf-8") for s in found.signatures]

    async def ticket(self, versions: Sequence[str], audience: str | None = None) -> TicketGrant:
        """An entitlement ticket naming this node, ``versions`` (403 for any it is not entitled to) and ``audience``."""
        body = TicketRequest(versions=list(versions), audience=audience)
        return parse(TicketGrant, await self._session.send("POST", "/v1/tickets", json=body))

    async def ticket_keys(self) -> TicketKeys:
        """The public keys tickets are signed with."""
        return parse(TicketKeys, await self._session.send("GET", "/v1/tickets/keys"))

    async def deployments(self) -> list[Deployment]:
        """Every deployment and its serving pointer (a cache pins the versions they name)."""
        return parse_list(Deployment, await self._session.send("GET", "/v1/deployments"))


def _poll_after(response: httpx.Response) -> float:
    """The answer's ``Poll-After`` seconds, bounded; 0 when absent or unreadable."""
    try:
        delay = float(response.headers.get(POLL_AFTER, 0))
    except ValueError:
        return 0.0
    return min(max(delay, 0.0), _MAX_POLL_AFTER) if delay == delay else 0.0  # NaN reads as 0
