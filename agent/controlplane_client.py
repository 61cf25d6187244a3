"""The agent's calls to the control plane: enrol, register, heartbeat, desired state, blob URLs, manifests, tickets.

An async ``httpx`` client with a bearer token: the node's own node token once it has one
(``use_token``); ``enrol`` alone sends the enrolment token it is given. Non-2xx answers map
to ``weightship`` errors through the shared ``error_from_response`` (one mapping for the CLI and
the agent); refused connections and timeouts become ``TemporaryError`` so the daemon's loops back
off and retry. Nothing here retries by itself: the loops own the backoff. The test seam is the
``transport`` argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from weightship.client import error_from_response
from weightship.digests import format_digest, hex_of, sha256_hex
from weightship.errors import IntegrityError, TemporaryError, WeightshipError
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

__all__ = ["ControlPlaneClient"]

_T = TypeVar("_T", bound=BaseModel)
#: blobs per URL request (the schema allows 10,000)
_URL_BATCH = 1000


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
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"User-Agent": "weightship-agent"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            follow_redirects=False,
        )

    async def aclose(self) -> None:
        """Close pooled connections."""
        await self._http.aclose()

    async def _send(
        self,
        method: str,
        path: str,
        *,
        json: BaseModel | None = None,
        params: dict[str, str | float] | None = None,
        read_timeout: float | None = None,
        token: str | None = None,
    ) -> httpx.Response:
        what = f"{method} {self.base_url}{path}"
        headers = {"Content-Type": "application/json"} if json is not None else {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            response = await self._http.request(
                method,
                path,
                content=None if json is None else json.model_dump_json().encode(),
                headers=headers or None,
                params=params,
                timeout=httpx.Timeout(read_timeout, connect=min(self.timeout, 5.0))
                if read_timeout
                else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TimeoutException as exc:
            raise TemporaryError(
                f"{what} timed out ({type(exc).__name__}): the control plane is slow or down"
            ) from None
        except httpx.TransportError as exc:
            raise TemporaryError(f"cannot reach the control plane for {what}: {exc!r}") from None
        if not response.is_success:
            raise error_from_response(response, what)
        return response

    @staticmethod
    def _parse(schema: type[_T], response: httpx.Response) -> _T:
        try:
            return schema.model_validate_json(response.content)
        except PydanticValidationError as exc:
            raise WeightshipError(
                f"{response.request.method} {response.request.url.path} answered a body that is not a "
                f"{schema.__name__}: {exc.errors()[0].get('msg', exc)}; is the control plane the same version?"
            ) from None

    def use_token(self, token: str) -> None:
        """Send ``token`` (the node token) with every call from now on."""
        self._http.headers["Authorization"] = f"Bearer {token}"

    async def enrol(self, request: NodeEnrolRequest, enrolment_token: str) -> NodeEnrolment:
        """Enrol this node with ``enrolment_token``; the answer holds the node token bound to it."""
        response = await self._send("POST", "/v1/nodes/enrol", json=request, token=enrolment_token)
        return self._parse(NodeEnrolment, response)

    async def register(self, registration: NodeRegistration) -> NodeInfo:
        """Re-register this node (same name, same id) with its node token."""
        return self._parse(NodeInfo, await self._send("POST", "/v1/nodes/register", json=registration))

    async def heartbeat(self, node_id: str, heartbeat: NodeHeartbeat) -> None:
        """Report inventory, what is served, counters, health, validation reports and refusals."""
        await self._send("POST", f"/v1/nodes/{quote(node_id, safe='')}/heartbeat", json=heartbeat)

    async def desired(self, node_id: str, after: str | None, wait: float) -> DesiredState:
        """The node's desired state; held by the control plane up to ``wait`` s while it equals ``after``."""
        params: dict[str, str | float] = {"wait": wait}
        if after is not None:
            params["after"] = after
        response = await self._send(
            "GET", f"/v1/nodes/{quote(node_id, safe='')}/desired", params=params, read_timeout=self.timeout + wait
        )
        return self._parse(DesiredState, response)

    async def blob_urls(self, blobs: Sequence[str]) -> dict[str, BlobURL]:
        """Short-lived range-capable read URLs for ``blobs`` (file sha256 hex), made absolute."""
        found: dict[str, BlobURL] = {}
        for start in range(0, len(blobs), _URL_BATCH):
            body = BlobURLRequest(blobs=list(blobs[start : start + _URL_BATCH]))
            urls = self._parse(BlobURLs, await self._send("POST", "/v1/blobs/urls", json=body))
            for blob, item in urls.urls.items():
                if not item.url.startswith(("http://", "https://")):
                    item = item.model_copy(update={"url": self.base_url + "/" + item.url.lstrip("/")})
                found[blob] = item
        return found

    async def manifest(self, model: str, digest: str) -> bytes:
        """The manifest bytes of ``digest``, checked to hash to ``digest``."""
        path = f"/v1/models/{quote(model, safe='')}/versions/{quote(digest, safe='')}/manifest"
        raw = (await self._send("GET", path)).content
        actual = format_digest(sha256_hex(raw))
        if actual != format_digest(hex_of(digest)):
            raise IntegrityError(f"the control plane sent a manifest hashing to {actual} for {digest}; refused")
        return raw

    async def ticket(self, versions: Sequence[str]) -> TicketGrant:
        """An entitlement ticket naming this node and ``versions`` (403 for any it is not entitled to)."""
        body = TicketRequest(versions=list(versions))
        return self._parse(TicketGrant, await self._send("POST", "/v1/tickets", json=body))

    async def ticket_keys(self) -> TicketKeys:
        """The public keys tickets are signed with."""
        return self._parse(TicketKeys, await self._send("GET", "/v1/tickets/keys"))

    async def deployments(self) -> list[Deployment]:
        """Every deployment and its serving pointer (a cache pins the versions they name)."""
        response = await self._send("GET", "/v1/deployments")
        try:
            return [Deployment.model_validate(item) for item in response.json()]
        except (ValueError, PydanticValidationError) as exc:
            raise WeightshipError(
                f"GET /v1/deployments answered a body that is not a list of deployments: {exc}"
            ) from None
