"""The S3 origin store (boto3; any ``endpoint_url``: AWS, MinIO, moto).

Blobs are uploaded by the client straight to S3 as multipart uploads created with
``ChecksumAlgorithm=SHA256`` (``COMPOSITE``): part ``n`` is chunk ``n - 1``, and its presigned
``UploadPart`` URL signs the header ``x-amz-checksum-sha256`` = base64 of the chunk digest, so S3
itself refuses a part whose bytes do not hash to it.

The upload never targets the blob's name. It goes to a staging key
``uploads/sha256/<sha>/<nonce>``, because S3 checks only part checksums: nothing S3 offers
verifies the *whole-file* SHA-256 of a multipart object (its full-object checksums are CRCs), so
completing straight to ``blobs/sha256/<sha>`` would let a client store any bytes under any name.
``complete_upload`` therefore:

1. ``ListParts``: every part present, of the right size, and its SHA-256 where S3 reports one;
2. ``CompleteMultipartUpload`` of the staging key, then the staged object's composite checksum
   (``HeadObject`` with checksum mode) against the composite of the manifest's chunk digests;
3. *verifying*: reads the staged object with parallel ranged GETs (pinned to its ETag) and hashes
   it whole, and every chunk too where S3 reported no checksum; a one-chunk blob whose part
   checksum is its file digest needs no read;
4. places it: a server-side multipart copy (``UploadPartCopy``, one part per chunk, so the blob
   keeps its composite checksum and works beyond CopyObject's 5 GiB) to ``blobs/sha256/<sha>``,
   completed with ``If-None-Match: *`` (write-once); then the staged object is deleted.

A staged object that fails 2 or 3 is deleted and the commit fails: bytes that do not match their
name never occupy it. Small objects (manifests, labels, provenance) are ``PutObject`` with
``If-None-Match: *`` and their SHA-256 checksum. Upload ids are ``<nonce>.<S3 upload id>``; the
nonce names the staging key. A bucket lifecycle rule expiring ``uploads/`` after a few days
cleans up after a control plane that died mid-commit.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

import boto3

from controlplane.persistence.store.origin import (
    UPLOADS,
    BlobStat,
    PartSpec,
    PartTarget,
    PartWriter,
    UploadedPart,
    blob_key,
    check_key,
)
from controlplane.persistence.store.parts import (
    StreamVerifier,
    b64_of_hex,
    check_uploaded,
    composite_checksum,
    hex_of_b64,
    normalize_checksum,
)
from controlplane.persistence.store.retrying import RetryPolicy, call
from weightship.digests import hex_of, sha256_hex
from weightship.errors import (
    ConflictError,
    IntegrityError,
    NotFoundError,
    PreconditionFailed,
    StoreError,
    ValidationError,
)
from weightship.logs import event
from weightship.manifest import Manifest

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ListObjectsV2OutputTypeDef

__all__ = ["MAX_PARTS", "MAX_PART_SIZE", "MIN_PART_SIZE", "S3Store"]

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PART_SIZE = 5 * 1024 * 1024 * 1024
MAX_PARTS = 10_000
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
_RANGE_SIZE = 8 * 1024 * 1024
#: ranged GETs in flight per blob read; memory stays within (_READERS + 1) * _RANGE_SIZE
_READERS = 8
#: UploadPartCopy requests in flight when a verified blob is placed
_COPIERS = 8
_NONCE = re.compile(r"[0-9a-f]{32}")
#: object metadata naming the part size a blob was uploaded with (its composite checksum depends on it)
_PART_SIZE_META = "ws-part-size"


class S3Store:
    """Origin store in an S3 bucket under an optional key prefix (see the module docstring)."""

    kind = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        policy: RetryPolicy | None = None,
        min_part_size: int = MIN_PART_SIZE,
        client: S3Client | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or None
        self.policy = policy or RetryPolicy()
        self.min_part_size = min_part_size
        self.client: S3Client = client or boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region,
            config=self.policy.botocore_config(path_style=self.endpoint_url is not None),
        )

    def describe(self) -> str:
        """``s3://bucket/prefix`` and the endpoint, if not AWS."""
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _what(self, op: str, key: str) -> str:
        return f"S3 {op} of s3://{self.bucket}/{self.prefix}{key}"

    def check_manifest(self, manifest: Manifest) -> None:
        """Chunks become parts: S3's part-size and part-count limits apply."""
        size = manifest.chunk_size
        if size > MAX_PART_SIZE:
            raise ValidationError(f"chunk_size {size} exceeds S3's {MAX_PART_SIZE}-byte part limit")
        for entry in manifest.files:
            if len(entry.chunks) > MAX_PARTS:
                raise ValidationError(
                    f"{entry.path} has {len(entry.chunks)} chunks, more than S3's {MAX_PARTS} parts; "
                    "rebuild the manifest with a larger chunk size"
                )
            if len(entry.chunks) > 1 and size < self.min_part_size:
                raise ValidationError(
                    f"chunk_size {size} is below this store's minimum part size {self.min_part_size} "
                    f"({entry.path} has {len(entry.chunks)} chunks); rebuild the manifest with a larger chunk size"
                )

    # --- small objects --------------------------------------------------------------------------

    def put_once(self, key: str, data: bytes) -> bool:
        """``PutObject`` with ``If-None-Match: *``."""
        checksum = b64_of_hex(sha256_hex(data))
        try:
            call(
                self.policy,
                self._what("PutObject", key),
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*", ChecksumSHA256=checksum
                ),
            )
        except PreconditionFailed:
            return False
        return True

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        """``GetObject`` of a small object, read whole."""

        def read() -> bytes:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            body = response["Body"]
            try:
                if response.get("ContentLength", 0) > max_bytes:
                    raise StoreError(f"{key} in {self.describe()} is larger than {max_bytes} bytes")
                return body.read()
            finally:
                body.close()

        return call(self.policy, self._what("GetObject", key), read)

    def list_keys(self, prefix: str) -> Iterator[str]:
        """``ListObjectsV2`` page by page, each page retried."""
        token = ""
        while True:
            page = call(self.policy, self._what("ListObjectsV2", prefix), partial(self._list_page, prefix, token))
            for item in page.get("Contents", []):
                key = item["Key"][len(self.prefix) :]
                try:
                    yield check_key(key)
                except ValidationError:
                    continue
            token = page.get("NextContinuationToken", "")
            if not page.get("IsTruncated") or not token:
                return

    def _list_page(self, prefix: str, token: str) -> ListObjectsV2OutputTypeDef:
        if token:
            return self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + prefix, ContinuationToken=token)
        return self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + prefix)

    # --- blobs ----------------------------------------------------------------------------------

    def _head(self, key: str) -> BlobStat | None:
        """``HeadObject`` with checksum mode on, or ``None`` if there is no such object."""
        try:
            head = call(
                self.policy,
                self._what("HeadObject", key),
                lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED"),
            )
        except NotFoundError:
            return None
        part_size = head.get("Metadata", {}).get(_PART_SIZE_META, "")
        return BlobStat(
            size=int(head.get("ContentLength", 0)),
            checksum=normalize_checksum(head.get("ChecksumSHA256")),
            etag=str(head.get("ETag", "")),
            part_size=int(part_size) if part_size.isdigit() else None,
        )

    def stat_blob(self, sha256: str) -> BlobStat | None:
        """``HeadObject`` of the blob, with checksum mode on."""
        return self._head(blob_key(sha256))

    def read_blob(self, sha256: str) -> Iterator[bytes]:
        """The blob in order, from parallel ranged GETs all pinned to one ETag."""
        stat = self.stat_blob(sha256)
        if stat is None:
            raise NotFoundError(f"blob {sha256} is not in the store {self.describe()}")
        return self._read(blob_key(sha256), stat.size, stat.etag)

    def _read(self, key: str, size: int, etag: str) -> Iterator[bytes]:
        """``key``'s bytes in order, as 8 MiB ranged GETs with up to ``_READERS`` in flight."""
        starts = iter(range(0, size, _RANGE_SIZE))
        pool = ThreadPoolExecutor(_READERS, thread_name_prefix="ws-s3-read")
        window: deque[Future[bytes]] = deque()

        def submit() -> None:
            start = next(starts, None)
            if start is not None:
                window.append(pool.submit(self._get_range, key, start, min(start + _RANGE_SIZE, size), etag))

        try:
            for _ in range(_READERS):
                submit()
            while window:
                piece = window.popleft().result()
                submit()
                yield piece
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        def read() -> bytes:
            response = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}", IfMatch=etag
            )
            body = response["Body"]
            try:
                return body.read()
            finally:
                body.close()

        data = call(self.policy, self._what("GetObject", key), read)
        if len(data) != end - start:
            raise StoreError(
                f"{self._what('GetObject', key)} returned {len(data)} bytes for a {end - start}-byte range"
            )
        return data

    # --- uploads --------------------------------------------------------------------------------

    def _staging(self, sha256: str, upload_id: str) -> tuple[str, str]:
        """The staging key and S3 multipart upload id that ``upload_id`` names."""
        nonce, _, multipart = upload_id.partition(".")
        if not _NONCE.fullmatch(nonce) or not multipart:
            raise NotFoundError(f"upload {upload_id!r} of blob {sha256} is not one this store opened (or predates it)")
        return f"{UPLOADS}{hex_of(sha256)}/{nonce}", multipart

    def begin_upload(self, sha256: str, part_size: int) -> str:
        """``CreateMultipartUpload`` of a fresh staging key, composite SHA-256; the part size goes in metadata."""
        nonce = secrets.token_hex(16)
        return f"{nonce}.{self._create_multipart(f'{UPLOADS}{hex_of(sha256)}/{nonce}', part_size)}"

    def _create_multipart(self, key: str, part_size: int | None) -> str:
        """``CreateMultipartUpload`` with composite SHA-256 checksums; the part size goes in metadata."""
        metadata = {_PART_SIZE_META: str(part_size)} if part_size else {}
        response = call(
            self.policy,
            self._what("CreateMultipartUpload", key),
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket,
                Key=self._key(key),
                ChecksumAlgorithm="SHA256",
                ChecksumType="COMPOSITE",
                ContentType="application/octet-stream",
                Metadata=metadata,
            ),
        )
        return str(response["UploadId"])

    def uploaded_parts(self, sha256: str, upload_id: str) -> dict[int, UploadedPart]:
        """``ListParts`` of the staging upload, all pages."""
        key, multipart = self._staging(sha256, upload_id)
        found: dict[int, UploadedPart] = {}
        marker = 0
        while True:
            page = call(
                self.policy,
                self._what("ListParts", key),
                partial(
                    self.client.list_parts,
                    Bucket=self.bucket,
                    Key=self._key(key),
                    UploadId=multipart,
                    PartNumberMarker=marker,
                ),
            )
            for part in page.get("Parts", []):
                number = int(part["PartNumber"])
                checksum = part.get("ChecksumSHA256")
                found[number] = UploadedPart(
                    number=number,
                    size=int(part["Size"]),
                    sha256=hex_of_b64(checksum) if checksum else None,
                    etag=str(part["ETag"]),
                )
            marker = int(page.get("NextPartNumberMarker", 0) or 0)
            if not page.get("IsTruncated") or not marker:
                return found

    def part_target(self, sha256: str, upload_id: str, part: PartSpec, expires_in: int) -> PartTarget | None:
        """A presigned ``UploadPart`` URL (to the staging key) that signs the part's SHA-256 checksum header."""
        key, multipart = self._staging(sha256, upload_id)
        checksum = b64_of_hex(part.sha256)
        url = self.client.generate_presigned_url(
            "upload_part",
            Params={
                "Bucket": self.bucket,
                "Key": self._key(key),
                "UploadId": multipart,
                "PartNumber": part.number,
                "ChecksumSHA256": checksum,
            },
            ExpiresIn=max(1, min(expires_in, MAX_PRESIGN_SECONDS)),
        )
        return PartTarget(url=url, headers={"x-amz-checksum-sha256": checksum})

    def open_part(self, sha256: str, upload_id: str, part: PartSpec) -> PartWriter:
        """Parts never stream through the control plane on S3."""
        raise ValidationError(
            f"the origin store is S3: PUT part {part.number} of blob {sha256} to its presigned url, "
            "not to the control plane"
        )

    def complete_upload(self, sha256: str, upload_id: str, parts: Sequence[PartSpec]) -> bool:
        """Complete to the staging key, verify the staged bytes, then place them under the blob's name."""
        gone = ConflictError(
            f"the upload of blob {sha256} is gone (aborted or expired); open the publish session again"
        )
        try:
            staged, multipart = self._staging(sha256, upload_id)
        except NotFoundError:
            raise gone from None
        try:
            uploaded: dict[int, UploadedPart] | None = self.uploaded_parts(sha256, upload_id)
        except NotFoundError:
            uploaded = None  # completed already (a retried commit), or aborted
        if uploaded is not None:
            check_uploaded(parts, uploaded, sha256)
            listing = [
                {"PartNumber": p.number, "ETag": uploaded[p.number].etag, "ChecksumSHA256": b64_of_hex(p.sha256)}
                for p in parts
            ]
            # NotFound: an earlier attempt of this call completed it; the head below finds it.
            with contextlib.suppress(NotFoundError):
                self._complete(staged, multipart, listing)
        head = self._head(staged)
        if head is None:
            if self.stat_blob(sha256) is not None:
                return False  # placed by an earlier attempt or another session
            raise gone
        self._verify_staged(sha256, staged, parts, head)
        placed = self._place(sha256, staged, parts, head)
        self._delete(staged, head.etag)
        event(log, "blob.published", store="s3", blob=sha256, parts=len(parts), placed=placed)
        return placed

    def _verify_staged(self, sha256: str, staged: str, parts: Sequence[PartSpec], head: BlobStat) -> None:
        """Hash the staged object (the whole file; every chunk too where S3 kept no checksum); delete it if wrong."""
        expected = sum(p.length for p in parts)
        covered = head.checksum is not None and head.checksum == composite_checksum([p.sha256 for p in parts])
        problem: IntegrityError | None = None
        if head.size != expected:
            problem = IntegrityError(f"blob {sha256}: the upload holds {head.size} bytes, the manifest says {expected}")
        elif head.checksum is not None and not covered:
            problem = IntegrityError(
                f"blob {sha256}: the parts S3 holds do not hash to the manifest's chunk digests "
                "(composite checksum differs); upload the parts again, then commit"
            )
        elif not (covered and len(parts) == 1 and parts[0].sha256 == hex_of(sha256)):
            # A one-part blob whose part checksum is its file digest is covered by S3 already.
            event(log, "blob.verifying", store="s3", blob=sha256, bytes=head.size, chunks=not covered)
            verifier = StreamVerifier(parts, sha256, chunks=not covered)
            for piece in self._read(staged, head.size, head.etag):
                verifier.feed(piece)
            try:
                verifier.finish(sha256)
            except IntegrityError as exc:
                problem = exc
        if problem is not None:
            self._delete(staged, head.etag)
            event(log, "blob.rejected", logging.WARNING, store="s3", blob=sha256, reason=problem.message)
            raise problem

    def _place(self, sha256: str, staged: str, parts: Sequence[PartSpec], head: BlobStat) -> bool:
        """Server-side copy of the verified staged object to the blob's key, write-once; ``False`` if taken."""
        key = blob_key(sha256)
        multipart = self._create_multipart(key, head.part_size)
        source = {"Bucket": self.bucket, "Key": self._key(staged)}

        def copy(part: PartSpec) -> dict[str, object]:
            response = call(
                self.policy,
                self._what("UploadPartCopy", key),
                lambda: self.client.upload_part_copy(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    UploadId=multipart,
                    PartNumber=part.number,
                    CopySource=source,  # type: ignore[arg-type]
                    CopySourceRange=f"bytes={part.offset}-{part.offset + part.length - 1}",
                    CopySourceIfMatch=head.etag,
                ),
            )
            result = response["CopyPartResult"]
            # The staged bytes were verified against this digest, so S3's own value must equal it.
            checksum = result.get("ChecksumSHA256") or b64_of_hex(part.sha256)
            return {"PartNumber": part.number, "ETag": str(result["ETag"]), "ChecksumSHA256": checksum}

        try:
            with ThreadPoolExecutor(min(_COPIERS, len(parts)), thread_name_prefix="ws-s3-copy") as pool:
                listing = list(pool.map(copy, parts))
            self._complete(key, multipart, listing)
        except PreconditionFailed:
            self._abort(key, multipart)
            return False
        except BaseException:
            self._abort(key, multipart)
            raise
        return True

    def _complete(self, key: str, multipart: str, listing: Sequence[dict[str, object]]) -> None:
        """``CompleteMultipartUpload`` with ``If-None-Match: *`` (``PreconditionFailed`` if ``key`` exists)."""
        call(
            self.policy,
            self._what("CompleteMultipartUpload", key),
            lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self._key(key),
                UploadId=multipart,
                MultipartUpload={"Parts": list(listing)},  # type: ignore[arg-type]
                IfNoneMatch="*",
            ),
        )

    def _delete(self, key: str, etag: str) -> None:
        """``DeleteObject`` of ``key`` if it still has ``etag``."""
        try:
            call(
                self.policy,
                self._what("DeleteObject", key),
                lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key), IfMatch=etag),
            )
        except (NotFoundError, PreconditionFailed):
            return

    def _abort(self, key: str, multipart: str) -> None:
        try:
            call(
                self.policy,
                self._what("AbortMultipartUpload", key),
                lambda: self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=multipart),
            )
        except NotFoundError:
            return

    def abort_upload(self, sha256: str, upload_id: str) -> None:
        """``AbortMultipartUpload`` of the staging upload, and the staged object if it was completed."""
        try:
            staged, multipart = self._staging(sha256, upload_id)
        except NotFoundError:
            return
        self._abort(staged, multipart)
        head = self._head(staged)
        if head is not None:
            self._delete(staged, head.etag)

    def read_url(self, sha256: str, expires_in: int) -> str | None:
        """A presigned ``GetObject`` URL (range requests work on it)."""
        return self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self._key(blob_key(sha256))},
            ExpiresIn=max(1, min(expires_in, MAX_PRESIGN_SECONDS)),
        )
