"""The HTTP endpoint a provider talks to: URL, timeout and headers checked once, and one bounded exchange.

Settings shared by the HTTP providers (``prometheus``, ``webhook``)::

    address / url: https://prometheus.monitoring:9090   # http or https; no user:password@ in it
    timeout: 10s                                         # whole exchange; default 10 s, at most 60 s
    headers:
      Authorization: {fromEnv: PROMETHEUS_AUTH}          # read from the control plane's environment
      X-Scope-OrgID: team-a                              # or a literal value

Secrets belong in ``fromEnv``: a spec is stored with the rollout and shown by ``rollout status``,
so a literal token there would be readable by everyone who can read rollouts. Header values never
appear in logs or error messages.

:func:`exchange` sends one request and bounds all of it: an ``asyncio`` deadline over connect,
send and the whole answer (httpx's own timeouts are per read, so a server trickling bytes could
otherwise hold a measurement forever), and a cap on the answer's size. Redirects are not followed,
and the process environment's proxy and ``.netrc`` settings are ignored, so a URL in a spec never
picks up credentials meant for another host. Failures map into ``weightship.errors``: timeouts,
refused connections, HTTP 429 and 5xx are ``TemporaryError``; everything else that is not 2xx is a
:class:`MeasurementError`.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from controlplane.rollouts.providers.base import MeasurementError, ProviderSpecError
from controlplane.rollouts.spec import RolloutSpecError, parse_duration
from weightship.errors import TemporaryError

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "MAX_ANSWER_BYTES",
    "MAX_TIMEOUT_SECONDS",
    "Answer",
    "HTTPProvider",
    "Header",
    "exchange",
    "new_client",
    "parse_headers",
    "parse_timeout",
    "parse_url",
    "raise_for_status",
    "resolve_headers",
]

DEFAULT_TIMEOUT_SECONDS = 10.0
#: A measurement slower than a minute is broken, and would stall the rollout's reconcile loop.
MAX_TIMEOUT_SECONDS = 60.0
#: Answers are a few numbers; anything this large is a wrong endpoint or a runaway query.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
MAX_HEADERS = 20

_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: Headers the provider sets itself, or that would change how the request is framed.
_RESERVED = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection", "te", "upgrade"})


@dataclass(frozen=True)
class Header:
    """One extra request header: a literal ``value`` or the environment variable ``from_env``."""

    name: str
    value: str | None = None
    from_env: str | None = None

    def __repr__(self) -> str:  # never show a literal value (it may be a token) in logs or errors
        source = f"fromEnv={self.from_env}" if self.from_env else "value=<hidden>"
        return f"Header({self.name}, {source})"


@dataclass(frozen=True)
class Answer:
    """A 2xx-or-not HTTP answer, its body read in full (within :data:`MAX_ANSWER_BYTES`)."""

    status: int
    body: bytes
    content_type: str


def parse_url(value: object, where: str) -> str:
    """An absolute ``http``/``https`` URL without credentials in it."""
    if not isinstance(value, str) or not value.strip():
        raise ProviderSpecError(f"{where}: expected an http(s) URL such as 'http://prometheus:9090', got {value!r}")
    if len(value) > 2048:
        raise ProviderSpecError(f"{where}: the URL is {len(value)} characters; the limit is 2048")
    try:
        url = httpx.URL(value.strip())
    except httpx.InvalidURL as exc:
        raise ProviderSpecError(f"{where}: {value!r} is not a valid URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ProviderSpecError(f"{where}: expected an http:// or https:// URL with a host, got {value!r}")
    if url.userinfo:
        raise ProviderSpecError(
            f"{where}: credentials in the URL would be stored with the rollout and shown in its status; "
            "remove them and send them as a header with fromEnv (see docs/rollouts.md, Providers)"
        )
    if url.fragment:
        raise ProviderSpecError(f"{where}: a URL fragment ('#…') is never sent; remove it from {value!r}")
    return str(url)


def parse_timeout(value: object, where: str) -> float:
    """Seconds for the whole exchange: default 10, more than 0 and at most 60."""
    if value is None:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = parse_duration(value, where)
    except RolloutSpecError as exc:
        raise ProviderSpecError(exc.message) from None
    if not 0 < seconds <= MAX_TIMEOUT_SECONDS:
        raise ProviderSpecError(f"{where}: expected more than 0 and at most {MAX_TIMEOUT_SECONDS:g}s, got {value!r}")
    return seconds


def parse_headers(value: object, where: str) -> tuple[Header, ...]:
    """``{name: "literal"}`` or ``{name: {fromEnv: VARIABLE}}`` per header."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ProviderSpecError(f"{where}: expected a mapping of header name to value, got {type(value).__name__}")
    if len(value) > MAX_HEADERS:
        raise ProviderSpecError(f"{where}: {len(value)} headers; the limit is {MAX_HEADERS}")
    headers = []
    for name, raw in value.items():
        field = f"{where}.{name}"
        if not isinstance(name, str) or not _TOKEN.match(name):
            raise ProviderSpecError(f"{where}: {name!r} is not a valid HTTP header name")
        if name.lower() in _RESERVED:
            raise ProviderSpecError(f"{field}: the provider sets this header itself; remove it")
        if isinstance(raw, str):
            if len(raw) > 8192 or any(ch in raw for ch in "\r\n\0"):
                raise ProviderSpecError(f"{field}: a header value must be one line of at most 8192 characters")
            headers.append(Header(name, value=raw))
        elif isinstance(raw, Mapping) and set(raw) == {"fromEnv"}:
            variable = raw["fromEnv"]
            if not isinstance(variable, str) or not _ENV_NAME.match(variable):
                raise ProviderSpecError(f"{field}.fromEnv: expected an environment variable name, got {variable!r}")
            headers.append(Header(name, from_env=variable))
        else:
            raise ProviderSpecError(f"{field}: expected a string or {{fromEnv: VARIABLE}}, got {type(raw).__name__}")
    return tuple(headers)


def resolve_headers(headers: tuple[Header, ...], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The header values to send; a missing variable is a :class:`MeasurementError` naming it."""
    env = os.environ if environ is None else environ
    resolved = {}
    for header in headers:
        if header.from_env is None:
            resolved[header.name] = header.value or ""
            continue
        value = env.get(header.from_env)
        if value is None or any(ch in value for ch in "\r\n\0"):
            raise MeasurementError(
                f"header {header.name!r} comes from the environment variable {header.from_env}, which is "
                "not set (or not one line) in the control plane process; set it there and retry the rollout"
            )
        resolved[header.name] = value
    return resolved


class HTTPProvider:
    """What the HTTP providers share: the outer check of their settings, a pooled client, the secrets' source.

    ``transport`` is the test seam; ``environ`` is where ``fromEnv`` headers are read (the process
    environment by default). The client is made on first use, inside the running event loop.
    """

    #: Settings keys a subclass accepts, and those it requires.
    fields: frozenset[str] = frozenset()
    required: tuple[str, ...] = ()

    def __init__(
        self, *, transport: httpx.AsyncBaseTransport | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._environ = environ

    def _checked(self, settings: object, where: str) -> Mapping[str, Any]:
        """``settings`` as a mapping with no unknown and every required key, or :class:`ProviderSpecError`."""
        if not isinstance(settings, Mapping):
            raise ProviderSpecError(f"{where}: expected a mapping of provider settings, got {type(settings).__name__}")
        unknown = sorted(set(map(str, settings)) - self.fields)
        if unknown:
            raise ProviderSpecError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(self.fields)}")
        for key in self.required:
            if key not in settings:
                raise ProviderSpecError(f"{where}.{key}: required")
        return settings

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = new_client(self._transport)
        return self._client

    def _headers(self, headers: tuple[Header, ...]) -> dict[str, str]:
        return resolve_headers(headers, self._environ)

    async def aclose(self) -> None:
        """Close pooled connections."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def new_client(transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The pooled client of one provider; ``transport`` is the test seam."""
    return httpx.AsyncClient(
        transport=transport,
        follow_redirects=False,
        trust_env=False,
        headers={"User-Agent": "weightship-controlplane"},
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
    )


async def exchange(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    seconds: float,
    what: str,
    data: Mapping[str, str] | None = None,
    content: bytes | None = None,
) -> Answer:
    """Send one request and read its answer within ``seconds`` and :data:`MAX_ANSWER_BYTES`."""
    request = client.build_request(
        method, url, headers=dict(headers), data=data, content=content, timeout=httpx.Timeout(seconds)
    )
    try:
        async with asyncio.timeout(seconds):
            response = await client.send(request, stream=True)
            try:
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise MeasurementError(
                            f"{what} answered more than {MAX_ANSWER_BYTES} bytes; a measurement is a few "
                            "numbers: check the URL and narrow the query"
                        )
            finally:
                await response.aclose()
    except (TimeoutError, httpx.TimeoutException):
        raise TemporaryError(
            f"{what} did not answer within {seconds:g}s; check that the service is up and the query is cheap, "
            "or raise the provider's timeout"
        ) from None
    except httpx.TransportError as exc:
        raise TemporaryError(f"{what} failed: cannot reach {request.url.host}:{request.url.port} ({exc})") from None
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return Answer(response.status_code, bytes(body), content_type)


def raise_for_status(answer: Answer, what: str, detail: str = "") -> None:
    """Raise the mapped error for a non-2xx ``answer``; ``detail`` is what the body said, if anything."""
    status = answer.status
    if 200 <= status < 300:
        return
    said = detail or answer.body[:200].decode("utf-8", "replace").strip() or "(empty body)"
    message = f"{what} answered HTTP {status}: {said}"
    if status == 429 or status >= 500:
        raise TemporaryError(message + "; the service is overloaded or failing: it is asked again next interval")
    if 300 <= status < 400:
        raise MeasurementError(message + "; redirects are not followed: put the final URL in the spec")
    raise MeasurementError(message)
