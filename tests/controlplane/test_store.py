"""The origin store's one interface, exercised by the same tests on both backends.

S3 runs against moto's server over HTTP (a separate process), the local store on ``tmp_path``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.persistence.store import (
    BlobStat,
    LocalStore,
    OriginStore,
    PartSpec,
    RetryPolicy,
    S3Store,
    blob_key,
    label_key,
    manifest_key,
    open_store,
    store_from_url,
)
from controlplane.persistence.store.origin import BLOBS, LABELS, MANIFESTS, UPLOADS, check_key
from controlplane.persistence.store.parts import stat_matches
from controlplane.settings import Settings
from weightship.chunks import chunk_ranges
from weightship.digests import sha256_hex
from weightship.errors import ConflictError, IntegrityError, NotFoundError, ValidationError
from weightship.manifest import FileEntry

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OriginStore]:
    """A fresh, empty store of each kind."""
    if request.param == "local":
        yield LocalStore(tmp_path / "origin")
        return
    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    yield S3Store(
        bucket,
        "pfx",
        endpoint_url=endpoint,
        min_part_size=CHUNK,
        policy=RetryPolicy(attempts=2, base_delay=0.01, read_timeout=10),
    )


def blob_of(data: bytes) -> tuple[FileEntry, list[PartSpec]]:
    """The manifest entry and parts of ``data`` as one file chunked at 64 KiB."""
    ranges = list(chunk_ranges(len(data), CHUNK))
    chunks = tuple(sha256_hex(data[a:b]) for a, b in ranges)
    entry = FileEntry(path="w.bin", size=len(data), sha256=sha256_hex(data), media_type="x", chunks=chunks)
    parts = [PartSpec(number=i + 1, offset=a, length=b - a, sha256=chunks[i]) for i, (a, b) in enumerate(ranges)]
    return entry, parts


def send_part(store: OriginStore, sha: str, upload_id: str, part: PartSpec, data: bytes) -> None:
    """What a client does with a part: PUT it to its presigned URL, or stream it through the control plane."""
    target = store.part_target(sha, upload_id, part, 600)
    if target is not None:
        response = httpx.put(target.url, content=data, headers=target.headers)
        assert response.status_code == 200, response.text
        return
    writer = store.open_part(sha, upload_id, part)
    writer.write(data)
    writer.finish()


def plant_part(store: OriginStore, sha: str, upload_id: str, part: PartSpec, data: bytes) -> None:
    """Put ``data`` in the store as ``part`` behind the checks a client meets (a rogue client or a bad disk)."""
    if isinstance(store, S3Store):
        staged, multipart = store._staging(sha, upload_id)
        store.client.upload_part(
            Bucket=store.bucket, Key=store.prefix + staged, UploadId=multipart, PartNumber=part.number, Body=data
        )
        return
    assert isinstance(store, LocalStore)
    staging = store.root / "staging" / upload_id
    with open(staging / "blob", "r+b") as handle:
        handle.seek(part.offset)
        handle.write(data)
    (staging / "parts" / str(part.number)).write_text(f"{part.length} {part.sha256}")


def upload(store: OriginStore, data: bytes) -> tuple[FileEntry, list[PartSpec], str]:
    """Open an upload of ``data`` and send every part, last first."""
    entry, parts = blob_of(data)
    upload_id = store.begin_upload(entry.sha256, CHUNK)
    for part in reversed(parts):
        send_part(store, entry.sha256, upload_id, part, data[part.offset : part.offset + part.length])
    return entry, parts, upload_id


def test_small_objects_are_written_once(store: OriginStore) -> None:
    """A second write to a key changes nothing and says so."""
    key = manifest_key("a" * 64)
    assert store.put_once(key, b"first") is True
    assert store.put_once(key, b"second") is False
    assert store.get_bytes(key, 100) == b"first"


def test_missing_objects_are_not_found(store: OriginStore) -> None:
    """Reading what is not there is a NotFoundError; a missing blob has no stat."""
    with pytest.raises(NotFoundError):
        store.get_bytes(manifest_key("b" * 64), 100)
    assert store.stat_blob("c" * 64) is None


def test_listing_returns_layout_keys_by_folder(store: OriginStore) -> None:
    """Keys come back relative to the store, filtered by folder."""
    store.put_once(manifest_key("1" * 64), b"m")
    store.put_once(label_key("llama", "v1"), b"l")
    store.put_once(blob_key("2" * 64), b"")
    assert sorted(store.list_keys(MANIFESTS)) == [manifest_key("1" * 64)]
    assert sorted(store.list_keys(LABELS)) == ["labels/llama/v1"]
    assert sorted(store.list_keys(BLOBS)) == [blob_key("2" * 64)]


@pytest.mark.parametrize(
    "key",
    ["../etc/passwd", "blobs/sha256/../../x", "labels/llama/../v1", "manifests/sha256/ABC", "labels/llama/.hidden"],
)
def test_keys_outside_the_layout_are_refused(key: str) -> None:
    """No key escapes the layout, whichever backend would have written it."""
    with pytest.raises(ValidationError):
        check_key(key)


def test_an_uploaded_blob_is_published_once_and_verified(store: OriginStore) -> None:
    """Parts sent in any order become one blob that matches its chunks; a second upload publishes nothing."""
    data = os.urandom(3 * CHUNK + 1234)
    entry, parts, upload_id = upload(store, data)
    assert sorted(store.uploaded_parts(entry.sha256, upload_id)) == [1, 2, 3, 4]
    assert store.complete_upload(entry.sha256, upload_id, parts) is True
    stat = store.stat_blob(entry.sha256)
    assert stat is not None
    assert stat_matches(stat, entry, CHUNK)
    assert b"".join(store.read_blob(entry.sha256)) == data
    _, _, again = upload(store, data)
    assert store.complete_upload(entry.sha256, again, parts) is False
    assert b"".join(store.read_blob(entry.sha256)) == data
    assert staged_objects(store) == []


def test_a_stored_blob_is_checked_against_the_chunks_it_was_verified_with(store: OriginStore) -> None:
    """Same size and chunking but other chunk digests: no match. Stored in other parts: only size counts."""
    data = os.urandom(2 * CHUNK + 5)
    entry, parts, upload_id = upload(store, data)
    store.complete_upload(entry.sha256, upload_id, parts)
    stat = store.stat_blob(entry.sha256)
    assert stat is not None
    other = replace(entry, chunks=tuple(reversed(entry.chunks)))
    assert stat_matches(stat, entry, CHUNK)
    assert not stat_matches(stat, other, CHUNK)
    assert not stat_matches(stat, replace(entry, size=entry.size + 1), CHUNK)
    rechunked = replace(entry, chunks=(sha256_hex(data[: 4 * CHUNK]),))
    assert stat_matches(stat, rechunked, 4 * CHUNK)


def test_a_blob_with_a_missing_part_is_not_published(store: OriginStore) -> None:
    """Completing before every part arrived is a ConflictError naming the part; nothing is published."""
    data = os.urandom(2 * CHUNK + 10)
    entry, parts = blob_of(data)
    upload_id = store.begin_upload(entry.sha256, CHUNK)
    send_part(store, entry.sha256, upload_id, parts[0], data[: parts[0].length])
    with pytest.raises(ConflictError, match="parts 2, 3"):
        store.complete_upload(entry.sha256, upload_id, parts)
    assert store.stat_blob(entry.sha256) is None


def test_a_corrupt_part_fails_completion_and_publishes_nothing(store: OriginStore) -> None:
    """A part whose bytes do not match its chunk digest is caught at completion; no blob remains."""
    data = os.urandom(3 * CHUNK)
    entry, parts = blob_of(data)
    upload_id = store.begin_upload(entry.sha256, CHUNK)
    for part in parts:
        send_part(store, entry.sha256, upload_id, part, data[part.offset : part.offset + part.length])
    plant_part(store, entry.sha256, upload_id, parts[1], os.urandom(CHUNK))
    with pytest.raises(IntegrityError):
        store.complete_upload(entry.sha256, upload_id, parts)
    assert store.stat_blob(entry.sha256) is None


class ChecksumlessS3Store(S3Store):
    """An S3-compatible store that keeps no checksums (some do not): the control plane must re-hash."""

    def _head(self, key: str) -> BlobStat | None:
        """The real head, minus the checksum."""
        stat = super()._head(key)
        return None if stat is None else replace(stat, checksum=None)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupt"])
def test_s3_without_checksums_falls_back_to_a_streaming_rehash(s3_server: str, s3_bucket: str, corrupt: bool) -> None:
    """Without checksums every byte is re-read and hashed: a match is published, a mismatch removed again."""
    s3 = ChecksumlessS3Store(s3_bucket, endpoint_url=s3_server, min_part_size=CHUNK)
    data = os.urandom(3 * CHUNK + 99)
    entry, parts, upload_id = upload(s3, data)
    if corrupt:
        plant_part(s3, entry.sha256, upload_id, parts[2], os.urandom(CHUNK))
        with pytest.raises(IntegrityError, match="parts 3 do not match"):
            s3.complete_upload(entry.sha256, upload_id, parts)
        assert s3.stat_blob(entry.sha256) is None
    else:
        assert s3.complete_upload(entry.sha256, upload_id, parts) is True
        assert b"".join(s3.read_blob(entry.sha256)) == data


def test_a_truncated_part_is_refused(store: OriginStore) -> None:
    """A part shorter than its chunk never counts: refused on arrival or at completion."""
    data = os.urandom(2 * CHUNK)
    entry, parts = blob_of(data)
    upload_id = store.begin_upload(entry.sha256, CHUNK)
    send_part(store, entry.sha256, upload_id, parts[1], data[CHUNK:])

    def send_short_then_complete() -> None:
        send_part(store, entry.sha256, upload_id, parts[0], data[: CHUNK - 100])
        store.complete_upload(entry.sha256, upload_id, parts)

    with pytest.raises(IntegrityError, match="bytes"):
        send_short_then_complete()
    assert store.stat_blob(entry.sha256) is None


def test_a_part_with_the_wrong_bytes_is_refused_on_arrival_locally(tmp_path: Path) -> None:
    """Through the control plane, a part is hashed before it is kept: wrong bytes never count as done."""
    store = LocalStore(tmp_path)
    data = os.urandom(2 * CHUNK)
    entry, parts = blob_of(data)
    upload_id = store.begin_upload(entry.sha256, CHUNK)
    writer = store.open_part(entry.sha256, upload_id, parts[0])
    writer.write(os.urandom(CHUNK))
    with pytest.raises(IntegrityError, match="hashes to"):
        writer.finish()
    assert store.uploaded_parts(entry.sha256, upload_id) == {}


def test_bytes_that_do_not_hash_to_the_blob_name_never_take_it(store: OriginStore) -> None:
    """Every chunk right, whole-file sha256 wrong: the re-hash refuses it; the name stays free and nothing is staged.

    On S3 each part passes S3's own checksum, so only the control plane's hash of the staged
    object catches it; afterwards the honest bytes of that name publish normally.
    """
    data = os.urandom(2 * CHUNK + 77)
    _entry, parts = blob_of(data)
    honest = os.urandom(3 * CHUNK)
    name = sha256_hex(honest)  # someone else's blob
    upload_id = store.begin_upload(name, CHUNK)
    for part in parts:
        send_part(store, name, upload_id, part, data[part.offset : part.offset + part.length])
    with pytest.raises(IntegrityError, match="whole file"):
        store.complete_upload(name, upload_id, parts)
    assert store.stat_blob(name) is None
    assert staged_objects(store) == []
    entry, honest_parts, honest_upload = upload(store, honest)
    assert store.complete_upload(entry.sha256, honest_upload, honest_parts) is True
    assert b"".join(store.read_blob(name)) == honest
    assert staged_objects(store) == []


def staged_objects(store: OriginStore) -> list[str]:
    """Keys left under S3's staging prefix (the local store stages outside its key space)."""
    if not isinstance(store, S3Store):
        return []
    listing = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + UPLOADS)
    return [item["Key"] for item in listing.get("Contents", [])]


def test_an_aborted_upload_is_gone(store: OriginStore) -> None:
    """Abort discards the parts; aborting again is harmless."""
    data = os.urandom(CHUNK + 1)
    entry, _parts, upload_id = upload(store, data)
    store.abort_upload(entry.sha256, upload_id)
    with pytest.raises(NotFoundError):
        store.uploaded_parts(entry.sha256, upload_id)
    store.abort_upload(entry.sha256, upload_id)


def test_s3_read_urls_serve_byte_ranges(s3_server: str, s3_bucket: str) -> None:
    """A presigned GET needs no credentials and answers range requests."""
    s3 = S3Store(s3_bucket, endpoint_url=s3_server, min_part_size=CHUNK)
    data = os.urandom(2 * CHUNK + 7)
    entry, parts, upload_id = upload(s3, data)
    s3.complete_upload(entry.sha256, upload_id, parts)
    url = s3.read_url(entry.sha256, 60)
    assert url is not None
    response = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert response.status_code == 206
    assert response.content == data[100:200]


def test_s3_refuses_chunks_smaller_than_its_part_minimum(s3_server: str, s3_bucket: str, tmp_path: Path) -> None:
    """A manifest S3 could not complete is refused up front, with the fix in the message."""
    from weightship.manifest import build_manifest

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes(b"{" + b" " * (3 * CHUNK) + b"}")
    manifest = build_manifest(tmp_path / "m", "tiny", chunk_size=CHUNK)
    with pytest.raises(ValidationError, match="larger chunk size"):
        S3Store(s3_bucket, endpoint_url=s3_server).check_manifest(manifest)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("local:{tmp}/o", "local"),
        ("s3://bucket", "s3"),
        ("s3://bucket/some/prefix?attempts=5&backoff=0.5&read_timeout=3&min_part_size=65536", "s3"),
    ],
)
def test_store_urls_pick_the_backend(url: str, kind: str, tmp_path: Path) -> None:
    """``local:`` and ``s3://`` URLs open the matching backend."""
    store = store_from_url(url.format(tmp=tmp_path), s3_endpoint_url="http://127.0.0.1:1")
    assert store.kind == kind


@pytest.mark.parametrize("url", ["local:", "s3://", "ftp://x", "s3://b?attempts=many", "s3://b?colour=red"])
def test_bad_store_urls_are_refused(url: str) -> None:
    """A store URL that names no backend, or a bad option, is a clear ValidationError."""
    with pytest.raises(ValidationError):
        store_from_url(url)


def test_open_store_reads_the_settings(tmp_path: Path) -> None:
    """The app's store comes from ``settings.store_url``."""
    store = open_store(Settings(store_url=f"local:{tmp_path / 'x'}"))
    assert isinstance(store, LocalStore)
    assert (tmp_path / "x" / "blobs" / "sha256").is_dir()


def test_boto_is_configured_with_the_policy(s3_server: str, s3_bucket: str) -> None:
    """Timeouts and botocore's own retries come from the retry policy."""
    policy = RetryPolicy(sdk_attempts=4, connect_timeout=1.5, read_timeout=2.5)
    client = S3Store(s3_bucket, endpoint_url=s3_server, policy=policy).client
    config: Any = client.meta.config  # botocore-stubs' Config declares none of the options it holds
    assert config.connect_timeout == 1.5
    assert config.read_timeout == 2.5
    assert config.retries["total_max_attempts"] == 4
