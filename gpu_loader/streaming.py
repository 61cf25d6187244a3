"""Streaming loads: tensors loaded as the chunks that hold them are verified, in any order.

A node that cold-starts on a version it does not hold yet loads while the agent still fetches
it (``agent.chunkfeed``, ``docs/loading.md``). The load is the ordinary one (the same plan, target,
staging memory, verification modes and hand-out of each tensor once every chunk it spans is
checked) with one difference: a reader takes an item only once every chunk it reads is *ready*,
that is listed by the agent as verified and written in place. Until then the item waits, so no
byte of a chunk in flight, of a sparse hole or of a chunk the agent rejected is ever read.

Readiness arrives from any thread, in any order, through ``StreamingPipeline.chunk_ready`` (and
``complete`` once the version is installed; ``fail`` to stop the load). A file is opened when its
header chunks are ready (its safetensors header is checked against the manifest then, as the
ordinary load does when it opens a file), and the descriptor is kept: the file being assembled
and the installed one are the same inode, so the agent's final rename does not disturb the load.

Verification modes keep their meaning: ``full`` hashes every chunk again with SHA-256 as it is
read; ``fast`` checks CRC32 records, which a file being written never matches, so it hashes with
SHA-256 too; ``trust`` reads only the needed bytes, trusting the agent's per-chunk verification
(what the feed lists) in place of the verification record a ready version carries.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_loader.checksums import ChecksumStore
from gpu_loader.dtypes import cast_itemsize, cast_target, check_cast_target, torch_dtype
from gpu_loader.errors import FileMismatchError
from gpu_loader.loader import Loader, LoadSession, VerifyMode, _select, resolve_device
from gpu_loader.pipeline import CheckPolicy, Pipeline
from gpu_loader.plan import CPU_ALIGN, CUDA_ALIGN, Item, LoadPlan, make_plan
from gpu_loader.sharding import ShardSpec
from gpu_loader.staging import StagingRing
from gpu_loader.targets import CpuTarget, CudaTarget, Target
from gpu_loader.validation import TensorStats, tensor_stats
from gpu_loader.version import OpenFile, Version, _check_header, open_version
from weightship.errors import ValidationError
from weightship.logs import event
from weightship.manifest import Manifest

__all__ = ["StreamProgress", "StreamingLoader", "StreamingPipeline", "StreamingSession", "streaming_session"]

_log = logging.getLogger(__name__)
#: how often a waiting reader looks whether the load was cancelled
_WAKE = 0.2
_CLOSED = -1


@dataclass
class StreamProgress:
    """How far a streaming load has come (read by ``/v1/status``)."""

    tensors_total: int = 0
    tensors_loaded: int = 0
    bytes_total: int = 0
    bytes_loaded: int = 0
    chunks_ready: int = 0
    first_tensor_at: float | None = None
    #: from the first chunk reported ready to the first tensor handed out
    first_tensor_ms: float | None = None


class StreamingPipeline(Pipeline):
    """A ``Pipeline`` whose readers take an item only once every chunk it reads is ready."""

    def __init__(
        self,
        plan: LoadPlan,
        files: list[OpenFile],
        target: Target,
        policy: CheckPolicy,
        *,
        readers: int,
        hash_workers: int,
        chunk_size: int,
    ) -> None:
        super().__init__(plan, files, target, policy, readers=readers, hash_workers=hash_workers)
        self._files = files
        self._chunk_size = chunk_size
        self._gate = threading.Condition()
        self._by_path = {fp.entry.path: i for i, fp in enumerate(plan.files)}
        self._ready: list[set[int]] = [set() for _ in plan.files]
        self._where: list[Path | None] = [None for _ in plan.files]
        self._waiting: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        self._missing: list[int] = []
        self._runnable: collections.deque[int] = collections.deque()
        self._taken = 0
        self.chunks_ready = 0
        #: ``time.perf_counter()`` when the first chunk was reported ready
        self.first_chunk_at: float | None = None
        for index, item in enumerate(plan.items):
            need = set(self._chunks_of(item.file, item.start, item.end))
            header = plan.files[item.file].entry.safetensors
            if header is not None:  # the file is opened (and its header checked) before any item of it
                need.update(self._chunks_of(item.file, 0, header.data_start))
            self._missing.append(len(need))
            for chunk in need:
                self._waiting[(item.file, chunk)].append(index)

    def _chunks_of(self, file: int, start: int, end: int) -> range:
        size = self._chunk_size
        return range(start // size, max(start, end - 1) // size + 1)

    def chunk_ready(self, path: str, chunk: int, location: str | os.PathLike[str]) -> None:
        """Chunk ``chunk`` of manifest file ``path`` is verified and in place in ``location``."""
        file = self._by_path.get(path)
        if file is None:
            return  # a file this load does not read
        with self._gate:
            self._where[file] = Path(location)
            if chunk in self._ready[file]:
                self._gate.notify_all()  # perhaps a new location for a file that could not be opened
                return
            self._ready[file].add(chunk)
            self.chunks_ready += 1
            if self.first_chunk_at is None:
                self.first_chunk_at = time.perf_counter()
            for index in self._waiting.pop((file, chunk), ()):
                self._missing[index] -= 1
                if self._missing[index] == 0:
                    self._runnable.append(index)
            self._gate.notify_all()

    def complete(self, directory: str | os.PathLike[str]) -> None:
        """The version is installed in ``directory``: every chunk is ready there."""
        root = Path(directory)
        for fp in self.plan.files:
            count = len(fp.entry.chunks)
            for chunk in range(count):
                self.chunk_ready(fp.entry.path, chunk, root / fp.entry.path)

    def fail(self, error: BaseException) -> None:
        """Stop the load with ``error`` (the consumer raises it)."""
        self._fail(error)
        with self._gate:
            self._gate.notify_all()

    def _take(self) -> Item | None:
        with self._gate:
            while True:
                if self._cancelled.is_set() or self._taken >= len(self.plan.items):
                    return None
                if self._runnable:
                    index = self._runnable.popleft()
                    item = self.plan.items[index]
                    if self._open(item.file):
                        self._taken += 1
                        return item
                    self._runnable.appendleft(index)  # renamed under us: wait for the new location
                self._gate.wait(_WAKE)

    def _open(self, file: int) -> bool:
        """Open ``file`` from its latest location once (under ``_gate``); False if it is not there."""
        if self._files[file].fd != _CLOSED:
            return True
        location = self._where[file]
        assert location is not None
        entry = self.plan.files[file].entry
        try:
            fd = os.open(location, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_size != entry.size:
                raise FileMismatchError(
                    f"{entry.path!r} at {location} is {st.st_size} bytes but the manifest says {entry.size}: "
                    "the agent's staging area does not match the version; re-fetch it"
                )
            if entry.safetensors is not None:
                _check_header(fd, entry, entry.safetensors)
        except BaseException:
            os.close(fd)
            raise
        self._files[file] = OpenFile(entry=entry, fd=fd, identity=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        return True


class StreamingSession(LoadSession):
    """A ``LoadSession`` over a ``StreamingPipeline``; iterate it like one, feed it from another thread.

    With ``scans`` set, each tensor's validation statistics (``validation.tensor_stats``) are computed
    as it is handed out, while later chunks are still in flight, instead of after the last one.
    """

    progress: StreamProgress
    scans: dict[str, TensorStats] | None = None

    @property
    def stream(self) -> StreamingPipeline:
        """The pipeline to report chunk readiness to."""
        assert isinstance(self._pipeline, StreamingPipeline)
        return self._pipeline

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        progress = self.progress
        for name, tensor in super().__iter__():
            if progress.first_tensor_at is None:
                progress.first_tensor_at = time.perf_counter()
                first_chunk = self.stream.first_chunk_at
                if first_chunk is not None:
                    progress.first_tensor_ms = (progress.first_tensor_at - first_chunk) * 1000
            progress.tensors_loaded += 1
            progress.bytes_loaded += tensor.numel() * tensor.element_size()
            progress.chunks_ready = self.stream.chunks_ready
            if self.scans is not None:
                self.scans.update((s.name, s) for s in tensor_stats({name: tensor}))
            yield name, tensor

    def close(self) -> None:
        """Release the files opened so far."""
        self._closed = True
        files = self._files
        for index, opened in enumerate(files):
            if opened.fd != _CLOSED:
                os.close(opened.fd)
                files[index] = OpenFile(entry=opened.entry, fd=_CLOSED, identity=opened.identity)


def streaming_session(
    loader: Loader,
    version: Version,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    verify: VerifyMode = "full",
    names: Iterable[str] | None = None,
) -> StreamingSession:
    """Plan a streaming load of ``version`` (its directory may still be filling); nothing is read yet.

    Report chunks to ``session.stream`` from any thread while the session is iterated. Tensor
    parallel slicing and CPU-mapped loads are not streamed (load those once the version is ready).
    """
    started = time.perf_counter()
    if verify not in ("full", "fast", "trust"):
        raise ValidationError(f"verify={verify!r} is not one of full, fast, trust")
    if loader.options.cpu_mapped:
        raise ValidationError("cpu_mapped loads map whole files and cannot stream: load the ready version instead")
    check_cast_target(dtype)
    dev = resolve_device(device)
    manifest: Manifest = version.manifest
    plan = make_plan(
        _select(version, names),
        shard=None,
        chunk_size=manifest.chunk_size,
        chunked=verify != "trust",
        block_size=loader.options.block_size,
        align=CUDA_ALIGN if dev.type == "cuda" else CPU_ALIGN,
        cast_itemsize=lambda name: cast_itemsize(name, dtype),
    )
    dtypes: list[tuple[torch.dtype, torch.dtype]] = []
    for slot in plan.slots:
        stored = torch_dtype(slot.dtype, slot.name, plan.files[slot.file].entry.path)
        dtypes.append((stored, cast_target(stored, dtype)))
    files = [OpenFile(entry=fp.entry, fd=_CLOSED, identity=(0, 0, 0, 0)) for fp in plan.files]
    store = ChecksumStore(loader.options.checksum_dir) if verify == "fast" else None
    policy = CheckPolicy(verify, store.read(version.digest) if store is not None else None)
    readers = loader.options.reader_count(dev)
    buffers = loader.options.staging_buffers or 2 * readers + 2
    target: Target
    pinned = 0
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            ring = loader._pinned_ring(buffers)
            target = CudaTarget(plan, dtypes, dev, ring, readers)
        pinned = ring.nbytes
    else:
        target = CpuTarget(plan, dtypes, align=CPU_ALIGN, scratch_buffers=buffers, block_size=loader.options.block_size)
    pipeline = StreamingPipeline(
        plan,
        files,
        target,
        policy,
        readers=readers,
        hash_workers=loader.options.hasher_count(),
        chunk_size=manifest.chunk_size,
    )
    session = StreamingSession(version, plan, dev, dtype, verify, files, target, pipeline, store, started, pinned)
    session.progress = StreamProgress(tensors_total=len(plan.slots), bytes_total=plan.tensor_bytes)
    event(_log, "load.stream_planned", digest=version.digest, tensors=len(plan.slots), items=len(plan.items))
    return session


class StreamingLoader(Loader):
    """A ``Loader`` whose sessions stream: each is handed to ``attach`` (which reports chunks to it).

    It shares ``base``'s options and pinned staging ring, so a streaming load holds no more memory
    than an ordinary one; ``load``, ``load_into`` and everything built on them work unchanged.
    """

    def __init__(self, base: Loader, attach: Callable[[StreamingSession], None], *, scan: bool = False) -> None:
        super().__init__(base.options)
        self._base = base
        self._attach = attach
        #: with ``scan``: every loaded tensor's validation statistics, by name (``validate(known=...)``)
        self.stats: dict[str, TensorStats] | None = {} if scan else None

    def _pinned_ring(self, wanted: int) -> StagingRing:
        return self._base._pinned_ring(wanted)

    def session(
        self,
        directory: str | os.PathLike[str],
        *,
        manifest: Manifest | None = None,
        digest: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        verify: VerifyMode = "full",
        shard: ShardSpec | None = None,
        names: Iterable[str] | None = None,
    ) -> LoadSession:
        """A streaming session of the version being assembled in ``directory``, attached to its feed."""
        if shard is not None:
            raise ValidationError("tensor-parallel loads are not streamed: load the version once it is ready")
        version = open_version(directory, manifest, digest, self.options.signing_policy)
        session = streaming_session(self, version, device=device, dtype=dtype, verify=verify, names=names)
        session.scans = self.stats
        self._attach(session)
        return session

    def close(self) -> None:
        """Nothing of its own to release (the ring is ``base``'s)."""
