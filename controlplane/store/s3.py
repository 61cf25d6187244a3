"""The S3 origin store (boto3; any ``endpoint_url``: AWS, MinIO, moto).

Blobs are uploaded by the client straight to S3 as multipart uploads created with
``ChecksumAlgorithm=SHA256`` (``COMPOSITE``): part ``n`` is chunk ``n - 1``, and its presigned
``UploadPart`` URL signs the header ``x-amz-checksum-sha256`` = base64 of the chunk digest, so S3
itself refuses a part whose bytes do not hash to it. Completing checks, without reading bytes:

1. ``ListParts``: every part present, of the right size, and its SHA-256 where S3 reports one;
2. ``CompleteMultipartUpload`` with ``If-None-Match: *`` (write-once) and each part's checksum;
3. the object's composite checksum (``HeadObject`` with checksum mode) against the composite of
   the manifest's chunk digests.

Only where the store reports no checksum at all does the control plane fall back to a streaming
re-hash of the object (ranged GETs, bounded memory). An object that fails step 3 is deleted
again (only if its ETag is still the one this completion created) and the commit fails: nothing
that does not match is left under ``blobs/``. Small objects (manifests, labels, provenance) are
``PutObject`` with ``If-None-Match: *`` and their SHA-256 checksum.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING

import boto3

from controlplane.store.origin import BlobStat, PartSpec, PartTarget, PartWriter, UploadedPart, blob_key, check_key
from controlplane.store.parts import (
    StreamVerifier,
    b64_of_hex,
    check_uploaded,
    composite_checksum,
    hex_of_b64,
    normalize_checksum,
)
from controlplane.store.retrying import RetryPolicy, call
from weightship.digests import sha256_hex
from weightship.errors import (
    ConflictError,
    IntegrityError,
    NotFoundError,
    PreconditionFailed,
    StoreError,
    ValidationError,
)
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

    def stat_blob(self, sha256: str) -> BlobStat | None:
        """``HeadObject`` with checksum mode on."""
        key = blob_key(sha256)
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

    def read_blob(self, sha256: str) -> Iterator[bytes]:
        """Ranged GETs of 8 MiB, each retried, all pinned to one ETag."""
        stat = self.stat_blob(sha256)
        if stat is None:
            raise NotFoundError(f"blob {sha256} is not in the store {self.describe()}")
        key = blob_key(sha256)
        for start in range(0, stat.size, _RANGE_SIZE):
            end = min(start + _RANGE_SIZE, stat.size) - 1

            def read(start: int = start, end: int = end) -> bytes:
                response = self.client.get_object(
                    Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end}", IfMatch=stat.etag
                )
                body = response["Body"]
                try:
                    return body.read()
                finally:
                    body.close()

            yield call(self.policy, self._what("GetObject", key), read)

    # --- uploads --------------------------------------------------------------------------------

    def begin_upload(self, sha256: str, part_size: int) -> str:
        """``CreateMultipartUpload`` with composite SHA-256 checksums; the part size goes in metadata."""
        key = blob_key(sha256)
        response = call(
            self.policy,
            self._what("CreateMultipartUpload", key),
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket,
                Key=self._key(key),
                ChecksumAlgorithm="SHA256",
                ChecksumType="COMPOSITE",
                ContentType="application/octet-stream",
                Metadata={_PART_SIZE_META: str(part_size)},
            ),
        )
        return str(response["UploadId"])

    def uploaded_parts(self, sha256: str, upload_id: str) -> dict[int, UploadedPart]:
        """``ListParts``, all pages."""
        key = blob_key(sha256)
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
                    UploadId=upload_id,
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
        """A presigned ``UploadPart`` URL that signs the part's SHA-256 checksum header."""
        checksum = b64_of_hex(part.sha256)
        url = self.client.generate_presigned_url(
            "upload_part",
            Params={
                "Bucket": self.bucket,
                "Key": self._key(blob_key(sha256)),
                "UploadId": upload_id,
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
        """Check the parts, complete write-once, then check the object's composite checksum."""
        key = blob_key(sha256)
        try:
            uploaded = self.uploaded_parts(sha256, upload_id)
        except NotFoundError:
            if self.stat_blob(sha256) is not None:
                return False  # completed by an earlier attempt or another session
            raise ConflictError(
                f"the upload of blob {sha256} is gone (aborted or expired); open the publish session again"
            ) from None
        check_uploaded(parts, uploaded, sha256)
        listing = [
            {"PartNumber": p.number, "ETag": uploaded[p.number].etag, "ChecksumSHA256": b64_of_hex(p.sha256)}
            for p in parts
        ]
        try:
            response = call(
                self.policy,
                self._what("CompleteMultipartUpload", key),
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    UploadId=upload_id,
                    MultipartUpload={"Parts": listing},  # type: ignore[typeddict-item]
                    IfNoneMatch="*",
                ),
            )
        except PreconditionFailed:
            self.abort_upload(sha256, upload_id)
            return False
        self._verify_published(sha256, parts, str(response.get("ETag", "")))
        log.info("blob_published store=s3 blob=%s parts=%d", sha256, len(parts))
        return True

    def _verify_published(self, sha256: str, parts: Sequence[PartSpec], etag: str) -> None:
        stat = self.stat_blob(sha256)
        if stat is None:
            raise StoreError(f"blob {sha256} vanished from {self.describe()} right after it was completed")
        if stat.checksum is not None:
            if stat.checksum == composite_checksum([p.sha256 for p in parts]):
                return
            problem = IntegrityError(
                f"blob {sha256}: the parts S3 holds do not hash to the manifest's chunk digests "
                "(composite checksum differs); upload the parts again, then commit"
            )
        else:
            verifier = StreamVerifier(parts, sha256)
            for piece in self.read_blob(sha256):
                verifier.feed(piece)
            try:
                verifier.finish(sha256)
                return
            except IntegrityError as exc:
                problem = exc
        key = blob_key(sha256)
        call(
            self.policy,
            self._what("DeleteObject", key),
            lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key), IfMatch=etag or stat.etag),
        )
        log.warning("blob_rejected store=s3 blob=%s reason=%r", sha256, problem.message)
        raise problem

    def abort_upload(self, sha256: str, upload_id: str) -> None:
        """``AbortMultipartUpload``; already gone is fine."""
        key = blob_key(sha256)
        try:
            call(
                self.policy,
                self._what("AbortMultipartUpload", key),
                lambda: self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id),
            )
        except NotFoundError:
            return

    def read_url(self, sha256: str, expires_in: int) -> str | None:
        """A presigned ``GetObject`` URL (range requests work on it)."""
        return self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self._key(blob_key(sha256))},
            ExpiresIn=max(1, min(expires_in, MAX_PRESIGN_SECONDS)),
        )
