"""S3 errors and timeouts: retried with backoff, then a clear error of the right kind.

A tiny fault-injecting HTTP proxy sits between the store and moto's server: it answers with an
S3 error, hangs, or forwards, per request, and counts what it saw. Backoff sleeps go to a fake
``sleep`` that only records them, so no test waits on a retry delay.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import pytest

from controlplane.persistence.store import RetryPolicy, S3Store, manifest_key
from controlplane.settings import Settings
from tests.controlplane.conftest import problem
from weightship.errors import StoreError, TemporaryError
from weightship.manifest import build_manifest

if TYPE_CHECKING:
    from tests.conftest import ModelMaker

pytestmark = pytest.mark.timeout(60)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_ERROR = "<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"


@dataclass
class Faults:
    """What the proxy does with request ``n`` (0-based): ``(status, code)``, ``"hang"`` or ``None`` (forward)."""

    plan: Callable[[int], tuple[int, str] | str | None] = lambda _n: None
    seen: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(faults: Faults, upstream: str) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1 so that botocore's "Expect: 100-continue" is answered at once, not after 1 s.
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            with faults.lock:
                n = len(faults.seen)
                faults.seen.append(f"{self.command} {self.path}")
            action = faults.plan(n)
            if action == "hang":
                faults.release.wait(30)  # released at teardown; the client times out long before
                return
            if isinstance(action, tuple):
                status, code = action
                payload = _ERROR.format(code=code).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port or 80, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "expect")}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

    return Handler


@pytest.fixture
def faults(s3_server: str) -> Iterator[tuple[Faults, str]]:
    """A fault proxy in front of moto; yields its plan and its URL."""
    plan = Faults()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(plan, s3_server))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield plan, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        plan.release.set()
        server.shutdown()
        server.server_close()


def store_via(endpoint: str, bucket: str, sleeps: list[float], **policy: float) -> S3Store:
    """An S3 store on ``endpoint`` whose backoff only records its sleeps."""
    args: dict[str, float] = {"attempts": 3, "sdk_attempts": 1, "base_delay": 0.5, "read_timeout": 5.0, **policy}
    return S3Store(
        bucket,
        endpoint_url=endpoint,
        policy=RetryPolicy(
            attempts=int(args["attempts"]),
            sdk_attempts=int(args["sdk_attempts"]),
            base_delay=args["base_delay"],
            read_timeout=args["read_timeout"],
            connect_timeout=1.0,
            sleep=sleeps.append,
        ),
    )


@pytest.mark.parametrize(
    ("status", "code"),
    [(500, "InternalError"), (503, "SlowDown"), (503, "ServiceUnavailable"), (429, "TooManyRequests")],
)
def test_server_errors_are_retried_then_reported_as_temporary(
    faults: tuple[Faults, str], s3_bucket: str, status: int, code: str
) -> None:
    """Every attempt fails: each is retried with growing backoff, then a TemporaryError names the call."""
    plan, url = faults
    plan.plan = lambda _n: (status, code)
    sleeps: list[float] = []
    store = store_via(url, s3_bucket, sleeps, attempts=4)
    with pytest.raises(TemporaryError, match=rf"PutObject.*{code}.*gave up after 4 attempts"):
        store.put_once(manifest_key("a" * 64), b"x")
    assert len(plan.seen) == 4
    assert len(sleeps) == 3
    assert all(0.0 <= s <= 0.5 * 2**i for i, s in enumerate(sleeps))


def test_botocore_retries_inside_each_of_our_attempts(faults: tuple[Faults, str], s3_bucket: str) -> None:
    """The two layers multiply: botocore's quick retries run inside each of ours."""
    plan, url = faults
    plan.plan = lambda _n: (500, "InternalError")
    store = store_via(url, s3_bucket, [], attempts=2, sdk_attempts=2)
    with pytest.raises(TemporaryError):
        store.stat_blob("a" * 64)
    assert len(plan.seen) == 2 * 2


def test_errors_that_pass_are_absorbed_by_retries(faults: tuple[Faults, str], s3_bucket: str) -> None:
    """Two throttled answers, then S3 is fine again: the write succeeds and reads back."""
    plan, url = faults
    plan.plan = lambda n: (503, "SlowDown") if n < 2 else None
    sleeps: list[float] = []
    store = store_via(url, s3_bucket, sleeps)
    assert store.put_once(manifest_key("b" * 64), b"payload") is True
    assert store.get_bytes(manifest_key("b" * 64), 100) == b"payload"
    assert len(sleeps) == 2


def test_a_hanging_store_times_out_and_is_reported_as_temporary(faults: tuple[Faults, str], s3_bucket: str) -> None:
    """A store that accepts but never answers costs read_timeout per attempt, then a TemporaryError."""
    plan, url = faults
    plan.plan = lambda _n: "hang"
    sleeps: list[float] = []
    store = store_via(url, s3_bucket, sleeps, attempts=2, read_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(TemporaryError, match="ReadTimeoutError"):
        store.stat_blob("c" * 64)
    assert time.monotonic() - started < 5
    assert len(plan.seen) == 2


def test_an_unreachable_store_is_reported_as_temporary(s3_bucket: str) -> None:
    """Nothing listens at the endpoint: retried, then a TemporaryError that says what to check."""
    sleeps: list[float] = []
    store = store_via(f"http://127.0.0.1:{closed_port()}", s3_bucket, sleeps)
    with pytest.raises(TemporaryError, match="reachable"):
        store.get_bytes(manifest_key("d" * 64), 10)
    assert len(sleeps) == 2


@pytest.mark.parametrize(("status", "code"), [(403, "AccessDenied"), (403, "SignatureDoesNotMatch")])
def test_access_errors_are_not_retried(faults: tuple[Faults, str], s3_bucket: str, status: int, code: str) -> None:
    """Retrying cannot fix credentials: one request, then a StoreError that says to check them."""
    plan, url = faults
    plan.plan = lambda _n: (status, code)
    store = store_via(url, s3_bucket, [])
    with pytest.raises(StoreError, match="credentials"):
        store.put_once(manifest_key("e" * 64), b"x")
    assert len(plan.seen) == 1


def test_a_missing_bucket_is_a_store_error(s3_server: str) -> None:
    """A bucket that does not exist is not retried and says how to fix it."""
    store = store_via(s3_server, "no-such-bucket-here", [])
    with pytest.raises(StoreError, match="bucket does not exist"):
        store.put_once(manifest_key("f" * 64), b"x")


@pytest.fixture
def cp_settings(tmp_path: Path, s3_bucket: str) -> Settings:
    """A control plane on SQLite whose S3 endpoint does not answer (used by the API-level outage test)."""
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'controlplane.db'}",
        store_url=f"s3://{s3_bucket}?attempts=2&backoff=0.01&connect_timeout=1&min_part_size=65536",
        s3_endpoint_url=f"http://127.0.0.1:{closed_port()}",
        admin_token="ws_fault-test-admin-token-0123456789",
    )


def test_an_s3_outage_reaches_publishers_as_a_503(
    cp_client: httpx.Client, cp_settings: Settings, make_model: ModelMaker
) -> None:
    """Through the API, an unreachable store is a 503 'unavailable' that says to retry, not a 500."""
    manifest = build_manifest(make_model("m", tensors_mb=0.1), "llama", chunk_size=64 * 1024)
    response = cp_client.post(
        "/v1/uploads",
        json={"manifest": manifest.raw.decode(), "labels": []},
        headers={"Authorization": f"Bearer {cp_settings.admin_token}"},
    )
    assert response.status_code == 503, response.text
    assert problem(response)["code"] == "unavailable"
    assert "retry" in problem(response)["detail"]
