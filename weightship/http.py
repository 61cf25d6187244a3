"""The HTTP core every weightship client is built on: one request path, sync and async.

``Session`` wraps a synchronous ``httpx.Client``, ``AsyncSession`` an ``httpx.AsyncClient``;
both share everything but the I/O (``_Core``):

- the base URL, the ``User-Agent``, the timeouts;
- the bearer token, sent only to the base URL's own origin: presigned S3 URLs carry their own
  signature and must never see it;
- JSON bodies from pydantic models, and answers parsed back into them (``parse``), with a
  message that names the version skew when an answer does not fit;
- one error mapping: a non-2xx answer through ``weightship.problems.error_from_response``, a
  refused connection or a timeout into a ``TemporaryError`` that names the server and says what to
  check. Callers catch our errors, never an ``httpx`` one;
- one retry engine (``weightship.backoff.Backoff``): temporary errors are retried, permanent ones
  stop at once. By default only reads (GET) are retried, because repeating a write whose answer
  was lost is not always harmless; ``retry=`` overrides that per call, and a client whose caller
  owns the retry loop (the agent's daemon) passes ``Backoff(attempts=1)``.

The test seam is the ``transport`` argument (an ``httpx.MockTransport``, or a unix-socket
transport for the agent's local API), never monkey-patching.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from weightship.backoff import Backoff
from weightship.errors import TemporaryError, WeightshipError
from weightship.problems import error_from_response

__all__ = [
    "VERSION",
    "AsyncSession",
    "Params",
    "RequestOptions",
    "Session",
    "SessionOptions",
    "parse",
    "parse_list",
    "segment",
]

try:
    VERSION = version("weightship")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"

_T = TypeVar("_T", bound=BaseModel)
Params = Mapping[str, str | int | float]
Timeout = httpx.Timeout | float | None


class SessionOptions(TypedDict, total=False):
    """What ``Session`` and ``AsyncSession`` are configured with, besides URL, token and transport."""

    #: names the server in messages ("the control plane")
    service: str
    #: what to check when it cannot be reached (a flag, an environment variable)
    advice: str
    #: seconds for each read, write and pool wait (default 30)
    timeout: float
    #: seconds to connect (default 10, never more than ``timeout``)
    connect_timeout: float
    #: the retry engine (default ``Backoff()``; ``Backoff(attempts=1)`` never retries)
    backoff: Backoff
    #: default ``weightship/<version>``
    user_agent: str


class RequestOptions(TypedDict, total=False):
    """What one ``send`` may carry besides method and URL."""

    #: a pydantic model sent as the JSON body
    json: BaseModel | None
    #: raw body bytes (part uploads)
    content: bytes | None
    headers: Mapping[str, str] | None
    params: Params | None
    #: this call's timeout (``read_timeout`` for long-polls); the session's when ``None``
    timeout: Timeout
    #: retry temporary failures; default: only GETs
    retry: bool | None
    #: a bearer token for this call instead of the session's
    token: str | None


def segment(value: str) -> str:
    """``value`` escaped as one path segment (a ``/`` in a name must not open another route)."""
    return quote(value, safe="")


def parse(schema: type[_T], response: httpx.Response) -> _T:
    """The body of ``response`` as ``schema``; a clear version-skew error when it does not fit."""
    try:
        return schema.model_validate_json(response.content)
    except PydanticValidationError as exc:
        raise _bad_answer(response, exc) from None


def parse_list(schema: type[_T], response: httpx.Response) -> list[_T]:
    """The body of ``response`` as a JSON list of ``schema``."""
    try:
        return TypeAdapter(list[schema]).validate_json(response.content)  # type: ignore[valid-type]
    except PydanticValidationError as exc:
        raise _bad_answer(response, exc) from None


def _bad_answer(response: httpx.Response, exc: PydanticValidationError) -> WeightshipError:
    errors = exc.errors()
    where, msg = (".".join(str(p) for p in errors[0]["loc"]), errors[0]["msg"]) if errors else ("", "")
    request = response.request
    return WeightshipError(
        f"the answer to {request.method} {request.url.path} does not match the weightship {VERSION} schema "
        f"({where}: {msg}); the server and this client are probably different versions: upgrade the older one"
    )


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One request, ready for either client: what to send, and how to name it in errors."""

    method: str
    url: httpx.URL
    content: bytes | None
    headers: dict[str, str]
    params: Params | None
    timeout: Timeout
    what: str
    retry: bool

    def build(self, client: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The ``httpx.Request`` for ``client`` (its defaults fill what this leaves unset)."""
        return client.build_request(
            self.method,
            self.url,
            content=self.content,
            headers=self.headers,
            params=self.params,
            timeout=self.timeout if self.timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )


class _Core:
    """Everything a request needs except the I/O; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        service: str = "the server",
        advice: str = "check the URL and that the server is running",
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
        backoff: Backoff | None = None,
        user_agent: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        self.timeout = timeout
        self.connect_timeout = min(timeout, connect_timeout)
        self.backoff = backoff or Backoff()
        self._service = service
        self._advice = advice
        self.user_agent = user_agent or f"weightship/{VERSION}"
        self._origin = httpx.URL(self.base_url + "/")

    def resolve(self, url: str) -> httpx.URL:
        """``url`` made absolute: paths are relative to the base URL."""
        if url.startswith(("http://", "https://")):
            return httpx.URL(url)
        return httpx.URL(self.base_url + "/" + url.lstrip("/"))

    def is_ours(self, url: httpx.URL) -> bool:
        """Whether ``url`` is on the base URL's origin (and may see the token)."""
        return (url.scheme, url.host, url.port) == (self._origin.scheme, self._origin.host, self._origin.port)

    def read_timeout(self, seconds: float) -> httpx.Timeout:
        """A timeout that waits ``seconds`` for the answer (long-polls, slow commits)."""
        return httpx.Timeout(self.timeout, connect=self.connect_timeout, read=seconds)

    def prepare(
        self,
        method: str,
        url: str,
        *,
        json: BaseModel | None = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Params | None = None,
        timeout: Timeout = None,
        retry: bool | None = None,
        token: str | None = None,
    ) -> _Prepared:
        target = self.resolve(url)
        all_headers = dict(headers or {})
        bearer = token or self.token
        if bearer and self.is_ours(target):
            all_headers["Authorization"] = f"Bearer {bearer}"
        body = content
        if json is not None:
            body = json.model_dump_json().encode("utf-8")
            all_headers["Content-Type"] = "application/json"
        return _Prepared(
            method=method,
            url=target,
            content=body,
            headers=all_headers,
            params=params,
            timeout=timeout,
            what=f"{method} {target.copy_with(query=None)}",
            retry=method == "GET" if retry is None else retry,
        )

    def unreachable(self, request: _Prepared, exc: httpx.HTTPError) -> TemporaryError:
        """The ``TemporaryError`` a transport failure (refused, reset, timed out) becomes."""
        where = self._service if self.is_ours(request.url) else f"{request.url.host}:{request.url.port}"
        advice = self._advice if self.is_ours(request.url) else "check that this machine can reach it"
        if isinstance(exc, httpx.TimeoutException):
            return TemporaryError(
                f"{request.what} timed out ({type(exc).__name__}): {where} is slow or unreachable; {advice}, then retry"
            )
        return TemporaryError(f"cannot reach {where} for {request.what}: {exc!r}; {advice}")

    def check(self, request: _Prepared, response: httpx.Response) -> httpx.Response:
        """``response`` if it is a success, else the mapped error raised."""
        if response.is_success:
            return response
        raise error_from_response(response, request.what)


class Session(_Core):
    """Synchronous requests to one server, with the shared error mapping and retries."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        max_connections: int = 64,
        **options: Unpack[SessionOptions],
    ) -> None:
        super().__init__(base_url, token, **options)
        self._http = httpx.Client(
            base_url=self.base_url,
            transport=transport,
            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
            headers={"User-Agent": self.user_agent},
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections // 2),
            follow_redirects=False,
        )

    def close(self) -> None:
        """Close pooled connections."""
        self._http.close()

    def send(self, method: str, url: str, **options: Unpack[RequestOptions]) -> httpx.Response:
        """Send one request; return its 2xx response or raise the mapped ``WeightshipError``.

        ``url`` is a path under the base URL or an absolute URL. GETs are retried on temporary
        failures unless ``retry`` says otherwise; ``token`` replaces the session's for this call.
        """
        request = self.prepare(method, url, **options)

        def once() -> httpx.Response:
            try:
                response = self._http.send(request.build(self._http))
            except httpx.HTTPError as exc:
                raise self.unreachable(request, exc) from None
            return self.check(request, response)

        return self.backoff.run(once) if request.retry else once()


class AsyncSession(_Core):
    """``Session`` for asyncio: the same request path, error mapping and retry engine."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        **options: Unpack[SessionOptions],
    ) -> None:
        super().__init__(base_url, token, **options)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
            headers={"User-Agent": self.user_agent},
            follow_redirects=False,
        )

    async def aclose(self) -> None:
        """Close pooled connections."""
        await self._http.aclose()

    async def send(self, method: str, url: str, **options: Unpack[RequestOptions]) -> httpx.Response:
        """Send one request; return its 2xx response or raise the mapped ``WeightshipError``."""
        request = self.prepare(method, url, **options)

        async def once() -> httpx.Response:
            try:
                response = await self._http.send(request.build(self._http))
            except httpx.HTTPError as exc:
                raise self.unreachable(request, exc) from None
            return self.check(request, response)

        return await self.backoff.run_async(once) if request.retry else await once()
