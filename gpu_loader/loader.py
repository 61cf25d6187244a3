"""The public loading API: a version directory in, verified tensors on a device out.

``Loader`` owns what is worth keeping between loads (one pinned staging ring, shared by its GPUs) and
runs one ``LoadSession`` per load: open the version and check what costs only a header read,
plan byte ranges, run the pipeline, and hand out each tensor once every chunk it spans is
verified. ``load_state_dict`` and ``load_into_module`` are the one-call forms.

Verification modes (see ``docs/loading.md`` for what each costs):

* ``full``: every chunk a tensor spans is SHA-256-hashed against the manifest in the same pass as
  the read; whole chunks are read even when a rank needs only part of one.
* ``fast``: each chunk's CRC32 is checked against the record this host wrote when it last
  verified that chunk with SHA-256 (``checksums``); unrecorded chunks get SHA-256.
* ``trust``: the agent's verification record for this exact version must exist and match;
  only the bytes the load needs are read, and nothing is hashed.

In every mode each weight file's size and safetensors header are checked against the manifest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, get_args

import torch
from torch import nn

from gpu_loader.checksums import ChecksumStore
from gpu_loader.dtypes import cast_itemsize, cast_target, check_cast_target, torch_dtype
from gpu_loader.errors import TensorMismatchError
from gpu_loader.pipeline import CheckPolicy, Pipeline
from gpu_loader.plan import CPU_ALIGN, CUDA_ALIGN, LoadPlan, TensorSlot, make_plan
from gpu_loader.sharding import ShardSpec
from gpu_loader.staging import StagingRing, pinned_allocation_size
from gpu_loader.targets import CpuTarget, CudaTarget, MappedTarget, Target
from gpu_loader.version import OpenFile, Version, open_version
from weightship.errors import ValidationError
from weightship.logs import event
from weightship.manifest import FileEntry, Manifest
from weightship.safetensors_header import TensorInfo
from weightship.signing_policy import SigningPolicy

__all__ = [
    "LoadOptions",
    "LoadResult",
    "LoadSession",
    "LoadStats",
    "Loader",
    "VerifyMode",
    "load_into_module",
    "load_state_dict",
    "resolve_device",
]

_log = logging.getLogger(__name__)

VerifyMode = Literal["full", "fast", "trust"]
_MODES: tuple[str, ...] = get_args(VerifyMode)


@dataclass(frozen=True)
class LoadOptions:
    """Pipeline knobs; the defaults suit local NVMe or page cache."""

    #: Reader threads; default 8 for a GPU, the core count (at least 2, at most 8) for CPU.
    readers: int | None = None
    #: Hashing threads; default one per core.
    hash_workers: int | None = None
    #: Bytes per read call and per staging buffer.
    block_size: int = 16 * 1024 * 1024
    #: Staging buffers: pinned on a GPU host (default ``2 * readers + 2``), plain scratch for cast
    #: or hash-only bytes on CPU (default ``readers + hash_workers``).
    staging_buffers: int | None = None
    #: Cap on the pinned memory of a ``Loader``'s one staging ring, shared by every device.
    pinned_limit: int = 512 * 1024 * 1024
    #: Where ``verify="fast"`` keeps its CRC32 records; default ``checksums.default_checksum_dir()``.
    checksum_dir: Path | None = None
    #: CPU loads only: tensors become copy-on-write views of the page cache instead of owned
    #: memory (zero-copy, fastest; see ``targets.MappedTarget`` for what that trades away).
    cpu_mapped: bool = False
    #: A signing policy (``weightship.signing_policy``): a version it refuses is not loaded (``SignatureRefused``).
    signing_policy: SigningPolicy | None = None

    def reader_count(self, device: torch.device) -> int:
        """Readers for a load onto ``device``."""
        if self.readers is not None:
            return max(1, self.readers)
        return 8 if device.type == "cuda" else max(2, min(8, os.cpu_count() or 2))

    def hasher_count(self) -> int:
        """Hash threads for a load."""
        return max(1, self.hash_workers or os.cpu_count() or 1)


@dataclass(frozen=True)
class LoadStats:
    """What a load did and how fast."""

    digest: str
    device: str
    verify: str
    files: int
    tensors: int
    bytes_read: int
    tensor_bytes: int
    chunks_sha256: int
    chunks_crc32: int
    seconds: float
    #: Pinned host memory the loader's staging ring holds (0 on CPU).
    pinned_bytes: int = 0

    @property
    def gbps(self) -> float:
        """Bytes read per second, in GB/s (10^9)."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class LoadResult:
    """A finished load: the state dict, its statistics and the version it came from."""

    tensors: dict[str, torch.Tensor]
    stats: LoadStats
    version: Version


def resolve_device(device: str | torch.device, *, device_count: int | None = None) -> torch.device:
    """The device a load goes to, with its index; a clear error for one this host does not have.

    ``device_count`` defaults to ``torch.cuda.device_count()`` (which creates no CUDA context).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValidationError(f"device {dev} is not supported: use 'cpu' or 'cuda:N'")
    count = torch.cuda.device_count() if device_count is None else device_count
    if count == 0:
        raise ValidationError(f"device {dev} asked for, but torch sees no CUDA device here; use device='cpu'")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index is not None and dev.index >= count:
        raise ValidationError(
            f"device {dev} asked for, but this process sees {count} CUDA device(s), cuda:0 to cuda:{count - 1} "
            "(CUDA_VISIBLE_DEVICES renumbers them); pass an index below the count"
        )
    return dev


@dataclass
class LoadSession:
    """One load, opened and planned but not yet read: iterate it for ``(name, tensor)`` pairs.

    Tensors come in completion order, each only after every chunk it spans is verified. On any
    failure iteration raises and hands out nothing more. ``stats`` is set once iteration ends.
    """

    version: Version
    plan: LoadPlan
    device: torch.device
    dtype: torch.dtype | None
    verify: str
    _files: list[OpenFile]
    _target: Target
    _pipeline: Pipeline
    _store: ChecksumStore | None
    _started: float
    _pinned_bytes: int = 0
    stats: LoadStats | None = None
    _closed: bool = field(default=False)

    def slot_dtype(self, slot: TensorSlot) -> torch.dtype:
        """The dtype ``slot``'s tensor is handed out in (after any cast)."""
        path = self.plan.files[slot.file].entry.path
        return cast_target(torch_dtype(slot.dtype, slot.name, path), self.dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._closed:
            raise RuntimeError("a LoadSession can be iterated once")
        self._closed = True
        ready = self._pipeline.ready()
        try:
            for index in ready:
                slot = self.plan.slots[index]
                path = self.plan.files[slot.file].entry.path
                stored = torch_dtype(slot.dtype, slot.name, path)
                tensor = self._target.tensor(index, stored, self._pipeline.events(index))
                wanted = cast_target(stored, self.dtype)
                # Cast on arrival already (the usual case), or cast whole here (tensors whose
                # elements could straddle a block: unaligned in old files).
                yield slot.name, (tensor.to(wanted) if tensor.dtype != wanted else tensor)
            record = self._pipeline.policy.record
            if self._store is not None and record is not None and record.changed:
                self._store.write(record)
            self._finish()
        finally:
            ready.close()  # stops and joins the reader threads before their files are closed
            self.close()

    def _finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        counters = self._pipeline.counters
        self.stats = LoadStats(
            digest=self.version.digest,
            device=str(self.device),
            verify=self.verify,
            files=len(self.plan.files),
            tensors=len(self.plan.slots),
            bytes_read=counters.bytes_read,
            tensor_bytes=self.plan.tensor_bytes,
            chunks_sha256=counters.chunks_sha256,
            chunks_crc32=counters.chunks_crc32,
            seconds=time.perf_counter() - self._started,
            pinned_bytes=self._pinned_bytes,
        )
        event(
            _log,
            "load.done",
            logging.INFO,
            digest=self.version.digest,
            device=self.device,
            verify=self.verify,
            tensors=self.stats.tensors,
            bytes_read=self.stats.bytes_read,
            seconds=self.stats.seconds,
            gbps=self.stats.gbps,
        )

    def close(self) -> None:
        """Release the open files (iteration does this itself)."""
        self._closed = True
        files, self._files = self._files, []
        for opened in files:
            os.close(opened.fd)

    def __enter__(self) -> LoadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Loader:
    """Loads versions onto devices; keeps one pinned staging ring, shared by every GPU, between loads."""

    def __init__(self, options: LoadOptions | None = None) -> None:
        self.options = options or LoadOptions()
        self._ring: StagingRing | None = None
        self._ring_lock = threading.Lock()

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
        """Open and plan a load; nothing is read until the session is iterated."""
        started = time.perf_counter()
        if verify not in _MODES:
            raise ValidationError(f"verify={verify!r} is not one of {', '.join(_MODES)}")
        check_cast_target(dtype)
        dev = resolve_device(device)
        version = open_version(directory, manifest, digest, self.options.signing_policy)
        if verify == "trust":
            version.check_verification()
        plan = make_plan(
            _select(version, names),
            shard=shard,
            chunk_size=version.manifest.chunk_size,
            chunked=verify != "trust",
            block_size=self.options.block_size,
            align=CUDA_ALIGN if dev.type == "cuda" else CPU_ALIGN,
            cast_itemsize=lambda name: cast_itemsize(name, dtype),
        )
        dtypes: list[tuple[torch.dtype, torch.dtype]] = []
        for slot in plan.slots:
            stored = torch_dtype(slot.dtype, slot.name, plan.files[slot.file].entry.path)
            dtypes.append((stored, cast_target(stored, dtype)))
        files = version.open_files([f.entry for f in plan.files])
        try:
            store = ChecksumStore(self.options.checksum_dir) if verify == "fast" else None
            policy = CheckPolicy(verify, store.read(version.digest) if store is not None else None)
            readers = self.options.reader_count(dev)
            # CPU scratch: a buffer per reader and per hasher keeps every thread busy; more would
            # only be faulted in while readers run ahead of hashing (each is a block of memory).
            buffers = self.options.staging_buffers or (
                2 * readers + 2 if dev.type == "cuda" else readers + self.options.hasher_count()
            )
            target: Target
            pinned = 0
            if dev.type == "cuda":
                # Everything CUDA (the ring's pinned memory included) is created under the target
                # device: a load onto cuda:3 must create no context on cuda:0.
                with torch.cuda.device(dev):
                    ring = self._pinned_ring(buffers)
                    target = CudaTarget(plan, dtypes, dev, ring, readers)
                pinned = ring.nbytes
            elif self.options.cpu_mapped:
                target = MappedTarget(plan, files, dtypes)
            else:
                target = CpuTarget(
                    plan, dtypes, align=CPU_ALIGN, scratch_buffers=buffers, block_size=self.options.block_size
                )
            pipeline = Pipeline(plan, files, target, policy, readers=readers, hash_workers=self.options.hasher_count())
        except BaseException:
            for opened in files:
                os.close(opened.fd)
            raise
        return LoadSession(version, plan, dev, dtype, verify, files, target, pipeline, store, started, pinned)

    def _pinned_ring(self, wanted: int) -> StagingRing:
        """The loader's one pinned ring (built on first use, under the current device), capped in size."""
        with self._ring_lock:
            if self._ring is None:
                size = self.options.block_size
                count = min(wanted, self.options.pinned_limit // pinned_allocation_size(size))
                if count < 1:
                    raise ValidationError(
                        f"pinned_limit={self.options.pinned_limit} bytes cannot hold one staging buffer of "
                        f"block_size={size} bytes; raise pinned_limit or lower block_size"
                    )
                self._ring = StagingRing(count, size, pinned=True)
                event(_log, "load.pinned_ring", logging.INFO, buffers=count, bytes=self._ring.nbytes)
            return self._ring

    def load(
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
    ) -> LoadResult:
        """Load tensors of a version onto ``device``; all verified, or an error and nothing."""
        session = self.session(
            directory,
            manifest=manifest,
            digest=digest,
            device=device,
            dtype=dtype,
            verify=verify,
            shard=shard,
            names=names,
        )
        tensors = dict(session)
        assert session.stats is not None
        return LoadResult(tensors=tensors, stats=session.stats, version=session.version)

    def load_into(
        self,
        module: nn.Module,
        directory: str | os.PathLike[str],
        *,
        manifest: Manifest | None = None,
        digest: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        verify: VerifyMode = "full",
        shard: ShardSpec | None = None,
        strict: bool = True,
    ) -> LoadResult:
        """Load a version into ``module`` (which may live on the meta device), adopting the tensors.

        Every module tensor must be in the version with the module's shape and dtype (after
        ``dtype`` casting); with ``strict`` the version may hold no others. Mismatches are found
        before any weight byte is read.
        """
        expected = module.state_dict()
        if device is None:
            first = next(iter(expected.values()), None)
            device = first.device if first is not None and first.device.type != "meta" else "cpu"
        version = open_version(directory, manifest, digest, self.options.signing_policy)
        available = _available(version)
        names = list(expected)
        if strict:
            unexpected = sorted(set(available) - set(expected))
            if unexpected:
                raise TensorMismatchError(
                    f"{directory} holds tensor(s) the module does not have: {_some(unexpected)}; "
                    "load with strict=False to ignore them, or use the module these weights belong to"
                )
        else:
            names = [n for n in names if n in available]
        session = self.session(
            directory, manifest=version.manifest, device=device, dtype=dtype, verify=verify, shard=shard, names=names
        )
        with session:
            _check_module(session, expected)
            tensors = dict(session)
        assert session.stats is not None
        module.load_state_dict(tensors, strict=strict, assign=True)
        return LoadResult(tensors=tensors, stats=session.stats, version=session.version)

    def close(self) -> None:
        """Give the pinned staging ring back to the system (a later load builds a new one)."""
        with self._ring_lock:
            ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _some(names: Sequence[str], shown: int = 5) -> str:
    head = ", ".join(repr(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _available(version: Version) -> dict[str, tuple[FileEntry, TensorInfo]]:
    found: dict[str, tuple[FileEntry, TensorInfo]] = {}
    for entry in version.weight_files():
        assert entry.safetensors is not None
        for info in entry.safetensors.tensors:
            found[info.name] = (entry, info)
    return found


def _select(version: Version, names: Iterable[str] | None) -> list[tuple[FileEntry, list[TensorInfo]]]:
    available = _available(version)
    if names is None:
        wanted = set(available)
    else:
        wanted = set(names)
        missing = sorted(wanted - set(available))
        if missing:
            files = ", ".join(repr(e.path) for e in version.weight_files())
            raise TensorMismatchError(
                f"tensor(s) {_some(missing)} are not in version {version.digest} (weight files: {files}); "
                "check that the version holds this model"
            )
    by_file: dict[str, tuple[FileEntry, list[TensorInfo]]] = {}
    for name in sorted(wanted):
        entry, info = available[name]
        by_file.setdefault(entry.path, (entry, []))[1].append(info)
    return [by_file[path] for path in sorted(by_file)]


def _check_module(session: LoadSession, expected: dict[str, torch.Tensor]) -> None:
    for slot in session.plan.slots:
        want = expected[slot.name]
        path = session.plan.files[slot.file].entry.path
        if tuple(want.shape) != slot.shape:
            raise TensorMismatchError(
                f"tensor {slot.name!r} in {path!r} has shape {list(slot.shape)} (for this rank) but the module expects "
                f"{list(want.shape)}: the version does not fit this model configuration"
            )
        got = session.slot_dtype(slot)
        if got != want.dtype:
            raise TensorMismatchError(
                f"tensor {slot.name!r} in {path!r} is {slot.dtype} ({got} after loading) but the module expects "
                f"{want.dtype}: pass dtype={want.dtype} to cast, or build the module in {got}"
            )


def load_state_dict(
    directory: str | os.PathLike[str],
    *,
    manifest: Manifest | None = None,
    digest: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    verify: VerifyMode = "full",
    shard: ShardSpec | None = None,
    names: Iterable[str] | None = None,
    options: LoadOptions | None = None,
) -> dict[str, torch.Tensor]:
    """Load a version's tensors onto ``device`` and return the state dict (see ``Loader.load``)."""
    with Loader(options) as loader:
        return loader.load(
            directory,
            manifest=manifest,
            digest=digest,
            device=device,
            dtype=dtype,
            verify=verify,
            shard=shard,
            names=names,
        ).tensors


def load_into_module(
    module: nn.Module,
    directory: str | os.PathLike[str],
    *,
    manifest: Manifest | None = None,
    digest: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    verify: VerifyMode = "full",
    shard: ShardSpec | None = None,
    strict: bool = True,
    options: LoadOptions | None = None,
) -> LoadStats:
    """Load a version into ``module`` and return the load's statistics (see ``Loader.load_into``)."""
    with Loader(options) as loader:
        return loader.load_into(
            module,
            directory,
            manifest=manifest,
            digest=digest,
            device=device,
            dtype=dtype,
            verify=verify,
            shard=shard,
            strict=strict,
        ).stats
