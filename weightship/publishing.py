"""Publishing a model directory: hash it, upload only what the store lacks, commit.

The protocol, client side::

    preflight                                 cheap checks before any hashing (below)
    build_manifest(dir)                       read every file once, chunk hashes in parallel
    POST /v1/uploads  {manifest, labels}  ->  UploadSession: per blob, present or the parts to PUT
    PUT  part.url  (part bytes, part.headers) for every part not yet done, in parallel, retried
    POST /v1/uploads/{id}/commit          ->  VersionInfo, once the server has verified every blob

Opening a session for a manifest that already has one resumes it: parts marked ``done`` are
skipped, so running the same publish again after a failure uploads only what is missing. Each
part (= one chunk) is read with ``os.pread`` at its offset, checked against the chunk digest from
the manifest before it is sent (a file edited during publish fails here, clearly, rather than at
commit), and sent to its URL: a presigned S3 multipart URL carrying the part's SHA-256 checksum
header, or a control-plane route for the local store. At most ``concurrency`` parts are in memory
and in flight at once.

Hashing hundreds of GB takes minutes, so everything that can fail cheaply is checked first
(``_preflight``): the control plane answers at that URL, the token is valid and may publish
(``GET /v1/tokens/self``), and no requested label already names other content. A taken label
is compared with the directory without hashing it all (chunk size, metadata, paths, sizes, small
files whole, the first chunk of the largest file): only a label that may name exactly this
content again lets hashing start, and the control plane still refuses a mismatch when the
session opens.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weightship.backoff import Backoff
from weightship.buffers import read_exact
from weightship.chunks import DEFAULT_CHUNK_SIZE
from weightship.digests import sha256_hex
from weightship.errors import ConflictError, ForbiddenError, IntegrityError, TemporaryError, WeightshipError
from weightship.manifest import DirectoryListing, Manifest, build_manifest, list_model_directory, parse_manifest
from weightship.schemas import PartUpload, Role, TokenInfo, UploadSession, VersionInfo
from weightship.signing import parse_bundle, sign_manifest

__all__ = ["PublishProgress", "PublishResult", "SilentProgress", "UploadAPI", "directory_size", "publish_directory"]


class UploadAPI(Protocol):
    """The control-plane calls a publish makes; ``weightship.client.Client`` implements them.

    Publishing depends on this, not on the client, so the client can import publishing (for
    ``Client.publish_directory``) without a cycle, and a test can hand in any implementation.
    """

    def whoami(self) -> TokenInfo:
        """The token in use: its name and role."""

    def label_digest(self, model: str, label: str) -> str | None:
        """The digest ``label`` of ``model`` names, or ``None`` while it is free."""

    def get_manifest(self, model: str, ref: str) -> bytes:
        """A version's manifest bytes exactly as stored."""

    def create_upload(
        self, manifest: bytes, labels: Sequence[str] = (), *, allow_pickle: bool = False
    ) -> UploadSession:
        """Open (or resume) the publish session of ``manifest``."""

    def upload_part(self, part: PartUpload, data: bytes) -> None:
        """PUT one part's bytes to its URL."""

    def commit_upload(self, upload_id: str, signatures: Sequence[bytes] = ()) -> VersionInfo:
        """Ask the control plane to verify every blob and make the version ready."""


class PublishProgress(Protocol):
    """What a publish reports while it runs; calls may come from worker threads."""

    def hashing(self, total_bytes: int) -> None:
        """Hashing starts over ``total_bytes``."""

    def hashed(self, nbytes: int) -> None:
        """``nbytes`` more were hashed."""

    def hash_done(self, total_bytes: int, seconds: float) -> None:
        """Hashing ended: ``total_bytes`` in ``seconds``, the figures ``PublishResult`` reports too."""

    def uploading(self, total_bytes: int, done_bytes: int) -> None:
        """Uploading starts: ``total_bytes`` must be in the store, ``done_bytes`` of them already are."""

    def uploaded(self, nbytes: int) -> None:
        """One more part of ``nbytes`` was accepted."""


class SilentProgress:
    """A ``PublishProgress`` that reports nothing."""

    def hashing(self, total_bytes: int) -> None:
        """Ignore."""

    def hashed(self, nbytes: int) -> None:
        """Ignore."""

    def hash_done(self, total_bytes: int, seconds: float) -> None:
        """Ignore."""

    def uploading(self, total_bytes: int, done_bytes: int) -> None:
        """Ignore."""

    def uploaded(self, nbytes: int) -> None:
        """Ignore."""


@dataclass(frozen=True)
class PublishResult:
    """What a publish did: the version, and where its bytes came from.

    ``bytes_total = bytes_deduplicated + bytes_resumed + bytes_uploaded``: bytes already in the
    store (this or another version had them), parts an earlier interrupted run already uploaded,
    and bytes this run sent. ``hash_seconds`` runs from the start of hashing to its end, the
    same span the progress bar's speed is measured over. ``skipped`` names what the naming rules
    left out of the version (hidden names such as ``.gitattributes``).
    """

    version: VersionInfo
    upload_id: str
    files: int
    bytes_total: int
    bytes_uploaded: int
    bytes_deduplicated: int
    bytes_resumed: int
    parts_uploaded: int
    hash_seconds: float
    upload_seconds: float
    commit_seconds: float
    skipped: tuple[str, ...] = ()
    #: signatures committed with the version (``model.sig``, ``--signature``, ``--sign-key``), and the
    #: time spent signing (building the statement from the manifest's digests: no byte is read again)
    signatures: int = 0
    sign_seconds: float = 0.0

    @property
    def hash_bytes_per_second(self) -> float:
        """Hashing speed: the one figure both the progress bar (at its end) and the summary show."""
        return self.bytes_total / self.hash_seconds if self.hash_seconds > 0 else 0.0


def _sizes(root: Path, listing: DirectoryListing) -> dict[str, int]:
    return {path: os.lstat(root / path).st_size for path in listing.paths}


def directory_size(root: Path) -> int:
    """Bytes of the files a publish of ``root`` hashes (hidden names skipped, links refused)."""
    return sum(_sizes(Path(root), list_model_directory(Path(root))).values())


#: Files up to this size are compared whole when a taken label is checked before hashing.
_SMALL_FILE = 1 << 20


def _preflight(
    client: UploadAPI,
    root: Path,
    listing: DirectoryListing,
    model: str,
    labels: Sequence[str],
    chunk_size: int,
    metadata: dict[str, str],
) -> None:
    """Fail in seconds on what would otherwise fail after hashing: URL, token, role, taken labels."""
    me = client.whoami()  # reachability and a valid token
    if me.role not in (Role.publisher, Role.admin):
        raise ForbiddenError(
            f"token {me.name!r} has role {me.role.value!r}; publishing needs role 'publisher' (or 'admin'): "
            "ask an admin for one (`weightship token create NAME --role publisher`) and pass it with --token"
        )
    for label in dict.fromkeys(labels):
        taken = client.label_digest(model, label)
        if taken is None:
            continue
        difference = _difference(client, root, listing, model, taken, chunk_size, metadata)
        if difference is not None:
            raise ConflictError(
                f"label {label!r} of model {model!r} already names {taken}, and {root} is other content "
                f"({difference}); labels never move: choose a new label, e.g. `--label {label}.1`; nothing was hashed"
            )


def _difference(
    client: UploadAPI,
    root: Path,
    listing: DirectoryListing,
    model: str,
    digest: str,
    chunk_size: int,
    metadata: dict[str, str],
) -> str | None:
    """How ``root`` certainly differs from version ``digest``, read cheaply; ``None`` if it may be the same."""
    theirs = parse_manifest(client.get_manifest(model, digest))
    if theirs.chunk_size != chunk_size:
        return f"that version uses chunk size {theirs.chunk_size}, this publish {chunk_size}"
    if dict(theirs.metadata) != metadata:
        return "its metadata differs"
    files = {f.path: f for f in theirs.files}
    ours = _sizes(root, listing)
    only_here = sorted(set(ours) - set(files))
    only_there = sorted(set(files) - set(ours))
    if only_here or only_there:
        return f"files only here: {only_here[:3]}, only there: {only_there[:3]}"
    for path, size in ours.items():
        if files[path].size != size:
            return f"{path} is {size} bytes here, {files[path].size} there"
    largest = max(ours, key=lambda p: ours[p])
    sampled = sorted({p for p, size in ours.items() if size <= _SMALL_FILE} | {largest})
    for path in sampled:
        entry = files[path]
        if entry.chunks and sha256_hex(_read_part(root / path, 0, min(chunk_size, entry.size))) != entry.chunks[0]:
            return f"{path} holds other bytes"
    return None


def _read_part(path: Path, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` at ``offset``; ``IntegrityError`` if the file is shorter now."""
    buf = bytearray(length)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exact(fd, memoryview(buf), offset, str(path))
    finally:
        os.close(fd)
    return bytes(buf)  # httpx sends bytes, not bytearray


class _Uploader:
    """Uploads the missing parts of one session, in parallel, each retried with backoff."""

    def __init__(
        self, client: UploadAPI, root: Path, manifest: Manifest, progress: PublishProgress, backoff: Backoff
    ) -> None:
        self.client = client
        self.backoff = backoff
        self.root = root
        self.progress = progress
        self.paths = {f.sha256: f.path for f in manifest.files}
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.parts_sent = 0

    def run(self, session: UploadSession, concurrency: int) -> None:
        """Upload every part of ``session`` that is not done; raise the first failure."""
        work = [
            (blob.sha256, part) for blob in session.blobs if not blob.present for part in blob.parts if not part.done
        ]
        if not work:
            return
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="ws-upload") as pool:
            futures: list[Future[None]] = [pool.submit(self._upload, sha, part) for sha, part in work]
            try:
                done, _pending = wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # Ctrl-C: send nothing more, let in-flight parts finish
                self._cancel(futures)
                raise
            failed = [f for f in done if f.exception() is not None]
            if failed:
                self._cancel(futures)
                raise failed[0].exception()  # type: ignore[misc]

    def _cancel(self, futures: list[Future[None]]) -> None:
        self.stop.set()
        for future in futures:
            future.cancel()

    def _upload(self, sha: str, part: PartUpload) -> None:
        if self.stop.is_set():
            return
        rel = self.paths.get(sha)
        if rel is None:
            raise WeightshipError(
                f"the control plane asked for blob {sha}, which is not in this manifest; "
                "abort the upload session and publish again"
            )
        try:
            data = _read_part(self.root / rel, part.offset, part.length)
        except IntegrityError:
            data = b""
        if len(data) != part.length or sha256_hex(data) != part.sha256:
            raise IntegrityError(
                f"{rel}: bytes {part.offset}-{part.offset + part.length} no longer match the digest hashed a moment "
                "ago; the file changed during publish: leave the directory alone and run publish again"
            )

        def attempt() -> None:
            if self.stop.is_set():
                return
            self.client.upload_part(part, data)

        try:
            self.backoff.run(attempt, lambda exc: isinstance(exc, TemporaryError) and not self.stop.is_set())
        except WeightshipError as exc:
            raise type(exc)(
                f"uploading part {part.number} of {rel} failed: {exc.message}; run the same publish command "
                "again to resume (parts already uploaded are kept)"
            ) from None
        if self.stop.is_set():
            return
        with self._lock:
            self.bytes_sent += part.length
            self.parts_sent += 1
        self.progress.uploaded(part.length)


def publish_directory(
    client: UploadAPI,
    root: Path,
    model: str,
    labels: Sequence[str] = (),
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    allow_pickle: bool = False,
    metadata: dict[str, str] | None = None,
    concurrency: int = 8,
    progress: PublishProgress | None = None,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = time.monotonic,
    signatures: Sequence[bytes] = (),
    sign_key: bytes | None = None,
) -> PublishResult:
    """Publish the model directory ``root`` as a version of ``model`` (see the module docstring).

    Checks the URL, the token's role and the labels before hashing anything (``_preflight``).

    Each part is retried on temporary failures with ``backoff`` (default: 5 attempts, capped
    exponential); the client's own backoff only governs reads.

    ``signatures`` (model-signing bundles, e.g. the directory's ``model.sig``) go with the commit;
    ``sign_key`` (an EC private key, PEM) adds one made from the manifest's digests, in the format
    ``model_signing verify`` accepts for the directory as it is (``weightship.signing``).
    """
    report: PublishProgress = progress or SilentProgress()
    listing = list_model_directory(root)
    _preflight(client, root, listing, model, labels, chunk_size, dict(metadata or {}))
    report.hashing(sum(_sizes(root, listing).values()))
    started = clock()
    manifest = build_manifest(
        root, model, chunk_size=chunk_size, allow_pickle=allow_pickle, metadata=metadata, progress=report.hashed
    )
    hashed = clock()
    report.hash_done(manifest.total_size, hashed - started)
    bundles = list(signatures)
    if sign_key is not None:
        bundles.append(sign_manifest(manifest, sign_key, ignore_paths=listing.skipped))
    signed = clock()
    for raw in bundles:
        parse_bundle(raw)  # a malformed signature is refused before anything is uploaded
    session = client.create_upload(manifest.raw, labels, allow_pickle=allow_pickle)
    if session.digest != manifest.digest:
        raise IntegrityError(
            f"the control plane opened session {session.id} for {session.digest}, but this manifest is "
            f"{manifest.digest}; the server altered the manifest: report this as a bug"
        )
    missing = [b for b in session.blobs if not b.present]
    to_store = sum(b.size for b in missing)
    resumed = sum(p.length for b in missing for p in b.parts if p.done)
    report.uploading(to_store, resumed)
    uploader = _Uploader(client, root, manifest, report, backoff or Backoff())
    uploader.run(session, concurrency)
    uploaded = clock()
    version = client.commit_upload(session.id, bundles)
    committed = clock()
    total = manifest.total_size
    return PublishResult(
        version=version,
        upload_id=session.id,
        files=len(manifest.files),
        bytes_total=total,
        bytes_uploaded=uploader.bytes_sent,
        bytes_deduplicated=total - to_store,
        bytes_resumed=resumed,
        parts_uploaded=uploader.parts_sent,
        hash_seconds=hashed - started,
        upload_seconds=uploaded - hashed,
        commit_seconds=committed - uploaded,
        skipped=listing.skipped,
        signatures=len(bundles),
        sign_seconds=signed - hashed,
    )
