"""``Client.publish_directory``: the client half of the upload protocol, against an in-memory peer.

The peer (``FakeOrigin``) speaks the protocol of ``weightship.schemas`` through an
``httpx.MockTransport``: it lists only the blobs it lacks, checks every part it receives against
the chunk digest, marks received parts ``done`` when a session is resumed, and assembles blobs at
commit. Faults are injected per request. The same flows run against the real control plane in
``test_cli_e2e.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from weightship.backoff import Backoff
from weightship.client import Client
from weightship.errors import ForbiddenError, IntegrityError, ManifestError, TemporaryError
from weightship.manifest import Manifest, build_manifest, parse_manifest
from weightship.publishing import SilentProgress, directory_size, publish_directory
from weightship.schemas import BlobUpload, PartUpload, Role, TokenInfo, UploadCreate, UploadSession, VersionInfo

pytestmark = pytest.mark.timeout(60)

BASE = "http://cp.test"
CHUNK = 64 * 1024
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
Fault = Callable[[httpx.Request], httpx.Response | None]


@dataclass
class FakeOrigin:
    """An in-memory control plane + store for the publish routes."""

    presigned: bool = False
    blobs: dict[str, bytes] = field(default_factory=dict)
    sessions: dict[str, tuple[Manifest, list[str], dict[tuple[str, int], bytes]]] = field(default_factory=dict)
    versions: dict[str, VersionInfo] = field(default_factory=dict)
    puts: list[tuple[str, int]] = field(default_factory=list)
    fault: Fault | None = None
    #: called while a part upload is counted in flight
    during_put: Callable[[], None] | None = None
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.fault is not None and (answer := self.fault(request)) is not None:
            return answer
        path = request.url.path
        if request.method == "POST" and path == "/v1/uploads":
            assert request.headers["authorization"] == "Bearer tok"
            return self._open(UploadCreate.model_validate_json(request.content))
        if request.method == "GET" and path == "/v1/tokens/self":  # the publish preflight
            me = TokenInfo(id="t1", name="ci", role=Role.publisher, created_at=NOW, created_by="admin")
            return httpx.Response(200, content=me.model_dump_json())
        if request.method == "PUT":
            return self._put(request)
        if request.method == "POST" and path.endswith("/commit"):
            return self._commit(path.split("/")[3])
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path}})

    def _part_url(self, upload_id: str, sha: str, number: int) -> str:
        if self.presigned:
            return (
                f"http://s3.test/bucket/blobs/sha256/{sha}?uploadId={upload_id}&partNumber={number}&X-Amz-Signature=x"
            )
        return f"/v1/uploads/{upload_id}/blobs/{sha}/parts/{number}"

    def _session(self, upload_id: str) -> UploadSession:
        manifest, labels, received = self.sessions[upload_id]
        blobs: dict[str, BlobUpload] = {}
        for entry in manifest.files:
            if entry.sha256 in self.blobs or entry.sha256 in blobs:
                continue
            parts = [
                PartUpload(
                    number=i + 1,
                    offset=i * CHUNK,
                    length=min(CHUNK, entry.size - i * CHUNK),
                    sha256=chunk,
                    url=self._part_url(upload_id, entry.sha256, i + 1),
                    headers={"x-amz-checksum-sha256": chunk[:8]} if self.presigned else {},
                    done=(entry.sha256, i + 1) in received,
                )
                for i, chunk in enumerate(entry.chunks)
            ]
            method = "s3-multipart" if self.presigned else "http-put"
            blobs[entry.sha256] = BlobUpload(
                sha256=entry.sha256, size=entry.size, present=False, method=method, parts=parts
            )
        missing = sum(b.size for b in blobs.values())
        return UploadSession(
            id=upload_id,
            model=manifest.model,
            digest=manifest.digest,
            state="open",
            expires_at=NOW + timedelta(days=1),
            labels=labels,
            blobs=list(blobs.values()),
            bytes_total=manifest.total_size,
            bytes_missing=missing,
        )

    def _open(self, body: UploadCreate) -> httpx.Response:
        manifest = parse_manifest(body.manifest.encode())
        upload_id = "u-" + manifest.digest[7:19]
        if upload_id not in self.sessions:
            self.sessions[upload_id] = (manifest, list(body.labels), {})
        return httpx.Response(201, content=self._session(upload_id).model_dump_json())

    def _put(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.during_put is not None:
                self.during_put()
            if self.presigned:
                assert "authorization" not in request.headers
                sha = request.url.path.rsplit("/", 1)[1]
                upload_id = request.url.params["uploadId"]
                number = int(request.url.params["partNumber"])
            else:
                assert request.headers["authorization"] == "Bearer tok"
                _, _, _, upload_id, _, sha, _, n = request.url.path.split("/")
                number = int(n)
            manifest, _, received = self.sessions[upload_id]
            entry = next(f for f in manifest.files if f.sha256 == sha)
            if hashlib.sha256(request.content).hexdigest() != entry.chunks[number - 1]:
                return httpx.Response(422, json={"error": {"code": "integrity", "message": "part digest"}})
            with self.lock:
                received[(sha, number)] = request.content
                self.puts.append((sha, number))
            return httpx.Response(204)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _commit(self, upload_id: str) -> httpx.Response:
        manifest, labels, received = self.sessions[upload_id]
        for entry in manifest.files:
            if entry.sha256 in self.blobs:
                continue
            data = b"".join(received[(entry.sha256, i + 1)] for i in range(len(entry.chunks)))
            assert hashlib.sha256(data).hexdigest() == entry.sha256
            self.blobs[entry.sha256] = data
        version = VersionInfo(
            model=manifest.model,
            digest=manifest.digest,
            labels=labels,
            state="ready",
            size=manifest.total_size,
            files=len(manifest.files),
            created_at=NOW,
            created_by="tok",
        )
        self.versions[manifest.digest] = version
        return httpx.Response(200, content=version.model_dump_json())


@dataclass
class RecordingProgress(SilentProgress):
    """Adds up what a publish reports."""

    hash_total: int = 0
    hashed_bytes: int = 0
    upload_total: int = 0
    upload_done: int = 0
    uploaded_bytes: int = 0
    on_uploading: Callable[[], None] | None = None

    def hashing(self, total_bytes: int) -> None:
        self.hash_total = total_bytes

    def hashed(self, nbytes: int) -> None:
        self.hashed_bytes += nbytes

    def uploading(self, total_bytes: int, done_bytes: int) -> None:
        self.upload_total, self.upload_done = total_bytes, done_bytes
        if self.on_uploading is not None:
            self.on_uploading()

    def uploaded(self, nbytes: int) -> None:
        self.uploaded_bytes += nbytes


def _client(origin: FakeOrigin) -> Client:
    return Client(BASE, "tok", transport=httpx.MockTransport(origin.handler), backoff=Backoff(sleep=lambda _s: None))


def _backoff(sleeps: list[float]) -> Backoff:
    return Backoff(attempts=4, sleep=sleeps.append)


def _model(make_model: Callable[..., Path], name: str, seed: int, extra: bytes = b"") -> Path:
    return make_model(name, tensors_mb=0.5, seed=seed, shards=2, extra_files={"tokenizer.json": b"{}" + extra})


@pytest.mark.parametrize("presigned", [False, True], ids=["control-plane-parts", "presigned-parts"])
def test_publish_uploads_every_part_once_and_reports_the_bytes(make_model: Any, presigned: bool) -> None:
    origin = FakeOrigin(presigned=presigned)
    root = _model(make_model, "m1", seed=1)
    progress = RecordingProgress()
    with _client(origin) as client:
        result = client.publish_directory(root, "llama", ["v1"], chunk_size=CHUNK, progress=progress)
    assert result.version.labels == ["v1"]
    assert result.bytes_uploaded == result.bytes_total == directory_size(root)
    assert result.bytes_deduplicated == 0
    assert result.parts_uploaded == len(origin.puts) == len(set(origin.puts))
    assert progress.hashed_bytes == progress.hash_total == result.bytes_total
    assert progress.uploaded_bytes == progress.upload_total == result.bytes_uploaded


def test_a_second_version_uploads_only_the_files_that_changed(make_model: Any) -> None:
    origin = FakeOrigin()
    with _client(origin) as client:
        first = client.publish_directory(_model(make_model, "m1", seed=1), "llama", ["v1"], chunk_size=CHUNK)
        changed = _model(make_model, "m2", seed=1, extra=b"changed tokenizer")
        second = client.publish_directory(changed, "llama", ["v2"], chunk_size=CHUNK)
    assert first.version.digest != second.version.digest
    assert second.bytes_uploaded == len(b"{}changed tokenizer")
    assert second.bytes_deduplicated == second.bytes_total - second.bytes_uploaded
    assert second.bytes_deduplicated > 0


def test_publishing_identical_content_again_uploads_nothing_and_keeps_the_digest(make_model: Any) -> None:
    origin = FakeOrigin()
    root = _model(make_model, "m1", seed=3)
    with _client(origin) as client:
        first = client.publish_directory(root, "llama", chunk_size=CHUNK)
        again = client.publish_directory(root, "llama", chunk_size=CHUNK)
    assert again.version.digest == first.version.digest
    assert again.bytes_uploaded == 0
    assert again.bytes_deduplicated == again.bytes_total


def test_an_interrupted_publish_resumes_and_skips_the_parts_already_sent(make_model: Any) -> None:
    origin = FakeOrigin()
    root = _model(make_model, "m1", seed=4)
    puts = 0

    def die_after_three(request: httpx.Request) -> httpx.Response | None:
        nonlocal puts
        if request.method == "PUT":
            puts += 1
            if puts > 3:
                return httpx.Response(403, json={"error": {"code": "forbidden", "message": "token revoked"}})
        return None

    origin.fault = die_after_three
    with _client(origin) as client, pytest.raises(ForbiddenError, match="run the same publish command again"):
        client.publish_directory(root, "llama", chunk_size=CHUNK, concurrency=1)
    sent_before = len(origin.puts)
    assert sent_before == 3
    origin.fault = None
    progress = RecordingProgress()
    with _client(origin) as client:
        result = client.publish_directory(root, "llama", chunk_size=CHUNK, progress=progress)
    first_three = sum(len(data) for data in list(next(iter(origin.sessions.values()))[2].values())[:3])
    assert result.bytes_resumed == progress.upload_done == first_three
    assert result.bytes_uploaded + result.bytes_resumed + result.bytes_deduplicated == result.bytes_total
    assert len(origin.puts) == len(set(origin.puts))  # no part was sent twice


def test_temporary_part_failures_are_retried_with_backoff(make_model: Any) -> None:
    origin = FakeOrigin(presigned=True)
    failures = {"left": 2}

    def flaky(request: httpx.Request) -> httpx.Response | None:
        if request.method == "PUT" and failures["left"] > 0:
            failures["left"] -= 1
            if failures["left"] == 1:
                raise httpx.ConnectError("connection reset by peer", request=request)
            return httpx.Response(503, text="<Error><Code>SlowDown</Code><Message>Reduce rate</Message></Error>")
        return None

    origin.fault = flaky
    sleeps: list[float] = []
    root = _model(make_model, "m1", seed=5)
    with _client(origin) as client:
        result = publish_directory(client, root, "llama", chunk_size=CHUNK, concurrency=1, backoff=_backoff(sleeps))
    assert len(sleeps) == 2
    assert result.bytes_uploaded == result.bytes_total


def test_a_part_that_keeps_failing_stops_the_publish_with_a_resume_hint(make_model: Any) -> None:
    origin = FakeOrigin()
    origin.fault = lambda r: httpx.Response(503, text="busy") if r.method == "PUT" else None
    sleeps: list[float] = []
    with _client(origin) as client, pytest.raises(TemporaryError) as caught:
        publish_directory(client, _model(make_model, "m1", seed=6), "llama", chunk_size=CHUNK, backoff=_backoff(sleeps))
    assert "run the same publish command again to resume" in caught.value.message
    assert origin.versions == {}


def test_uploads_stay_within_the_concurrency_bound(make_model: Any) -> None:
    origin = FakeOrigin()
    first_two = threading.Barrier(2, timeout=10)
    arrivals = itertools.count()

    def overlap() -> None:
        # Hold the first two parts until both are in flight at once, proving parallelism.
        if next(arrivals) < 2:
            first_two.wait()

    origin.during_put = overlap
    with _client(origin) as client:
        client.publish_directory(make_model("big", tensors_mb=2.0, seed=7), "llama", chunk_size=CHUNK, concurrency=2)
    assert origin.max_in_flight == 2


def test_a_file_edited_during_publish_fails_before_its_bytes_are_sent(make_model: Any) -> None:
    origin = FakeOrigin()
    root = _model(make_model, "m1", seed=8)
    victim = root / "model-00001-of-00002.safetensors"

    def tamper() -> None:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))

    with _client(origin) as client, pytest.raises(IntegrityError, match="changed during publish"):
        client.publish_directory(root, "llama", chunk_size=CHUNK, progress=RecordingProgress(on_uploading=tamper))
    assert origin.versions == {}


def test_a_directory_that_breaks_the_manifest_rules_is_refused_before_any_request(make_model: Any) -> None:
    origin = FakeOrigin()
    root = make_model("pickled", tensors_mb=0.1, extra_files={"pytorch_model.bin": b"\x80\x04"})
    with _client(origin) as client, pytest.raises(ManifestError, match="pickle"):
        client.publish_directory(root, "llama", chunk_size=CHUNK)
    assert origin.sessions == {}


def test_a_server_that_opens_a_session_for_another_manifest_is_refused(make_model: Any) -> None:
    origin = FakeOrigin()
    other = _model(make_model, "other", seed=9)

    def swap(request: httpx.Request) -> httpx.Response | None:
        if request.url.path == "/v1/uploads":
            forged = UploadCreate(manifest=build_manifest(other, "llama", chunk_size=CHUNK).raw.decode())
            origin.fault = None
            answer = origin._open(forged)
            origin.fault = swap
            return answer
        return None

    origin.fault = swap
    with _client(origin) as client, pytest.raises(IntegrityError, match="altered the manifest"):
        client.publish_directory(_model(make_model, "m1", seed=10), "llama", chunk_size=CHUNK)
    assert json.dumps(origin.puts) == "[]"
