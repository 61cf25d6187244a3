"""Assembling one version end to end, from manifest to an installed ``versions/<hex>/``.

1. The manifest: the copy in the staging area if a fetch was interrupted (so a restart does
   not even need the control plane for it), else from the control plane, checked to hash to
   the version digest before it is parsed.
2. The staging area is opened; after an interruption every journaled chunk is hashed again.
3. Files identical to a file of a ready version are hard-linked (zero bytes written).
4. Retention makes room for the bytes still to be written, or raises ``DiskFullError``.
5. The fetcher places every missing chunk (local copies, then range requests), verified.
6. The files are made read-only, the verification record is written, and the directory is
   renamed into ``versions/``; only then does the version count as ready. With a ``Flusher``,
   the version is flushed to disk just after (``agent.durability``); without one, before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, TypeVar

from agent.counters import Counters
from agent.durability import Flusher
from agent.fetcher import Fetcher
from agent.retention import Retention
from agent.signatures import SignatureGate
from agent.staging import Staging
from agent.store import VersionStore
from weightship.digests import hex_of
from weightship.errors import IntegrityError, WeightshipError
from weightship.layout import MANIFEST_FILE, META_DIR
from weightship.logs import event
from weightship.manifest import Manifest, manifest_bytes_match, parse_manifest
from weightship.signing import write_directory_signatures

__all__ = ["Assembler", "ManifestSource", "Progress"]

log = logging.getLogger("agent.assemble")

#: how often a running fetch logs its progress
PROGRESS_LOG_SECONDS = 10.0
_R = TypeVar("_R")


class ManifestSource(Protocol):
    """Whatever serves manifest bytes (the control-plane client)."""

    async def manifest(self, model: str, digest: str) -> bytes:
        """The manifest bytes of ``digest``."""
        ...


@dataclass
class Progress:
    """How far the assembly of one version has come; read by heartbeats.

    ``trouble`` is the last failed chunk attempt of the running fetch that is being retried (and
    ``trouble_at`` when the first one happened), so a fetch that keeps failing shows as
    retrying, not as ``fetching 0%``.
    """

    bytes_total: int = 0
    bytes_present: int = 0
    trouble: WeightshipError | None = None
    trouble_at: datetime | None = None


class Assembler:
    """Turns a version digest into a ready, verified ``versions/<hex>/``."""

    def __init__(
        self,
        store: VersionStore,
        retention: Retention,
        fetcher: Fetcher,
        manifests: ManifestSource,
        counters: Counters,
        executor: Executor,
        protected: Callable[[], set[str]],
        on_trouble: Callable[[], None] = lambda: None,
        on_placed: Callable[[], None] = lambda: None,
        gate: SignatureGate | None = None,
        flusher: Flusher | None = None,
    ) -> None:
        self.store = store
        #: makes ready versions durable in the background; None: each is flushed before it is ready
        self.flusher = flusher
        #: the node's signing policy, checked before any chunk of a version is fetched (``agent.signatures``)
        self.gate = gate
        self.on_trouble = on_trouble
        #: called on the event loop after each chunk is verified in place (wakes streaming readers)
        self.on_placed = on_placed
        self.retention = retention
        self.fetcher = fetcher
        self.manifests = manifests
        self.counters = counters
        self.executor = executor
        self.protected = protected
        #: stagings being fetched or left by a failed or cancelled fetch, by digest: the peer listener
        #: serves their verified chunks (the daemon drops one when retention evicts it)
        self.staging: dict[str, Staging] = {}

    async def _run(self, fn: Callable[..., _R], *args: object) -> _R:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def manifest(self, model: str, digest: str) -> Manifest:
        """The verified, parsed manifest of ``digest``."""
        staged = self.store.staging_dir / hex_of(digest) / META_DIR / MANIFEST_FILE
        raw = await self._run(_read_staged_manifest, staged, digest)
        if raw is None:
            raw = await self.manifests.manifest(model, digest)
        manifest = parse_manifest(raw)
        if manifest.digest != digest:
            raise IntegrityError(f"manifest for {digest} has digest {manifest.digest}; refused")
        return manifest

    def cleared(self, digest: str) -> bool:
        """Whether the node's signing policy now in effect accepted ``digest`` (always, without a policy)."""
        return self.gate is None or self.gate.accepted(digest)

    async def assemble(self, model: str, digest: str, progress: Progress) -> None:
        """Fetch, verify and install ``digest``; raises a ``WeightshipError`` saying what failed.

        A version already on disk is only checked against the signing policy (nothing is fetched):
        a switch back to it must pass the policy in effect now, as a fetch would.
        """
        began = time.monotonic()
        progress.trouble = progress.trouble_at = None
        on_disk = self.store.ready().get(digest)
        manifest = on_disk or await self.manifest(model, digest)
        progress.bytes_total = manifest.total_size
        if on_disk is not None:
            progress.bytes_present = manifest.total_size
        if self.gate is not None:
            await self.gate.check(manifest)  # before a byte of the version is fetched, or it is served again
        if on_disk is not None:
            return  # on disk and verified already: only the node's policy had to agree (``cleared``)
        staging = Staging(self.store.staging_dir, manifest)
        resumed = staging.journal_path.exists()
        try:
            await self._run(staging.open)
            if self.gate is not None and self.gate.passed_with.get(digest):
                await self._run(write_directory_signatures, staging.dir, self.gate.passed_with[digest])
            if resumed:
                await self._run(staging.reverify)
            self.staging[digest] = staging  # served from now on, in place of an earlier try's (re-checked above)
            linked = await self._run(staging.link_identical, self.store.local_files())
            self.counters.add(bytes_copied_locally=linked)
            self.on_placed()
            progress.bytes_present = staging.bytes_present()
            jobs = staging.jobs()
            need = sum(job.bytes_placed for job in jobs)
            event(
                log,
                "assemble.start",
                digest=digest,
                bytes_total=manifest.total_size,
                bytes_present=progress.bytes_present,
                bytes_linked=linked,
                bytes_needed=need,
                resumed=resumed,
            )
            # The protected set is read here, on the event loop, where it is kept.
            await self._run(self.retention.make_room, digest, need, self.protected())

            started = last_log = time.monotonic()
            start_bytes = progress.bytes_present

            def placed(n: int) -> None:
                nonlocal last_log
                progress.bytes_present += n
                self.retention.progress(digest, n)
                self.on_placed()
                now = time.monotonic()
                if now - last_log >= PROGRESS_LOG_SECONDS:
                    last_log = now
                    rate = (progress.bytes_present - start_bytes) / max(now - started, 1e-9)
                    event(
                        log,
                        "fetch.progress",
                        digest=digest,
                        bytes_present=progress.bytes_present,
                        bytes_total=manifest.total_size,
                        mb_per_s=f"{rate / 1e6:.1f}",
                    )

            def trouble(error: WeightshipError) -> None:
                progress.trouble = error
                if progress.trouble_at is None:
                    progress.trouble_at = datetime.now(UTC)
                    self.on_trouble()  # report "retrying" now, not at the next periodic heartbeat

            try:
                local = {**self.store.local_chunks(), **staging.own_chunks()}
                await self.fetcher.fetch(staging, local, placed, trouble)
            finally:
                self.retention.release(digest)
            # Only a fetch that ended well stops serving from the staging area here. One that failed
            # (a full disk stops our downloads, not our uploads) or was cancelled leaves its verified
            # chunks on disk and announced: they stay served until the next try or an eviction.
            self.staging.pop(digest, None)
            sync = self.flusher is None
            final = await self._run(staging.finish, sync)
            installed = await self._run(self.store.install, final, manifest, sync)
            staging.discard_journal()
            if self.flusher is not None:
                self.flusher.schedule(installed, digest)
        finally:
            staging.close()
        progress.bytes_present = manifest.total_size
        seconds = time.monotonic() - began
        event(
            log,
            "assemble.ready",
            digest=digest,
            bytes=manifest.total_size,
            bytes_placed=need,
            seconds=f"{seconds:.3f}",
            mb_per_s=f"{need / max(seconds, 1e-9) / 1e6:.1f}",
        )


def _read_staged_manifest(path: Path, digest: str) -> bytes | None:
    """The manifest bytes left in a staging area by an interrupted fetch, if they hash to ``digest``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return raw if manifest_bytes_match(raw, digest) else None
