"""Where read bytes land: straight into CPU tensors, through pinned staging onto a GPU, or mapped.

Every target holds one *arena* per weight file (a flat ``uint8`` tensor, see ``plan``), gives a
reader the memory each block lands in, and fills it:

* ``CpuTarget`` gives the arena's own memory (and scratch for bytes only hashed), so a CPU load
  makes no extra copy: ``preadv`` writes the final tensor bytes.
* ``CudaTarget`` gives a pinned staging buffer; after the read it queues one ``copy_`` per piece
  on the reader's own CUDA stream (``non_blocking``, so the copy engine runs while the reader
  reads the next block) and records an event that gates reuse of the buffer and use of the
  tensors.
* ``MappedTarget`` (CPU, opt-in) maps each file copy-on-write and makes the tensors views of the
  page cache: "reading" a block is faulting its pages in (``MADV_POPULATE_READ``) and hashing
  reads them in place. No memory is allocated or zeroed and nothing is copied, so it is the
  fastest CPU load; the cost is that tensor memory stays backed by the file (see
  ``docs/loading.md``: evicted pages are re-read from disk without re-verification, and a file
  truncated under a running process faults it).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from threading import Event

import numpy as np
import torch

from gpu_loader.errors import FileMismatchError
from gpu_loader.plan import Block, LoadPlan, TensorSlot
from gpu_loader.staging import StagingBuffer, StagingRing
from gpu_loader.version import OpenFile

__all__ = ["CpuTarget", "CudaTarget", "MappedTarget", "ReadBuffer", "Target", "read_into"]


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def _noop() -> None:
    pass


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order (contiguous) element strides of ``shape``."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return tuple(strides)


def read_into(fd: int, views: Sequence[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` (in order) from ``fd`` at ``offset``, across short reads."""
    pending = [v for v in views if len(v)]
    first = 0
    while first < len(pending):
        n = os.preadv(fd, pending[first : first + _IOV_MAX], offset)
        if n == 0:
            raise FileMismatchError(
                f"{path!r} ended at byte {offset}, before the bytes the manifest promises: "
                "the file was truncated while loading; re-fetch the version"
            )
        offset += n
        while n:
            head = pending[first]
            if n >= len(head):
                n -= len(head)
                first += 1
            else:
                pending[first] = head[n:]
                n = 0


@dataclass(slots=True)
class ReadBuffer:
    """Memory one block is read into (views tiling the block, in order) and how to give it back."""

    views: list[memoryview]
    release: Callable[[], None]
    staging: StagingBuffer | None = None


class Target:
    """Common part: arenas and turning a slot into a typed tensor view."""

    def __init__(self, device: torch.device, arenas: list[torch.Tensor]) -> None:
        self.device = device
        self.arenas = arenas
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """Memory to read ``block`` into; ``None`` when the load was cancelled while waiting."""
        raise NotImplementedError

    def fill(self, file: int, opened: OpenFile, block: Block, buf: ReadBuffer) -> None:
        """Bring the block's bytes into ``buf``."""
        read_into(opened.fd, buf.views, block.start, opened.entry.path)

    def after_read(self, reader: int, file: int, block: Block, buf: ReadBuffer) -> torch.cuda.Event | None:
        """Move the block on towards the device; an event that completes when it is there."""
        return None

    def tensor(self, slot: TensorSlot, dtype: torch.dtype, events: list[torch.cuda.Event]) -> torch.Tensor:
        """The tensor of ``slot`` (its bytes complete), usable on the caller's current stream."""
        return self._view(slot.file, slot.arena_offset, slot, dtype)

    def _view(self, file: int, offset: int, slot: TensorSlot, dtype: torch.dtype) -> torch.Tensor:
        size = dtype.itemsize
        if offset % size:  # unaligned in the file (old writers): a copy makes a typed view possible
            return self.arenas[file][offset : offset + slot.nbytes].clone().view(dtype).reshape(slot.shape)
        # One typed view of the arena per dtype, then one as_strided per tensor: a third of the
        # cost of slice + view + reshape, which adds up over the thousands of tensors of a model.
        typed = self._typed.get((file, dtype))
        if typed is None:
            arena = self.arenas[file]
            typed = arena[: arena.numel() - arena.numel() % size].view(dtype)
            self._typed[(file, dtype)] = typed
        return typed.as_strided(slot.shape, _strides(slot.shape), offset // size)

    def finish(self) -> None:
        """Wait for device work this load queued (before arenas may be freed or handed out)."""


class CpuTarget(Target):
    """Reads land in the final CPU tensors' memory."""

    def __init__(self, plan: LoadPlan) -> None:
        # numpy asks the kernel for transparent huge pages on large allocations (torch's CPU
        # allocator does not): 512 times fewer first-touch page faults while preadv fills them.
        arrays = [np.empty(f.arena_size, dtype=np.uint8) for f in plan.files]
        super().__init__(torch.device("cpu"), [torch.from_numpy(a) for a in arrays])
        self._memory = [a.data.cast("B") for a in arrays]

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """Views of the arena where pieces land, fresh scratch where they are only hashed."""
        arena = self._memory[file]
        views = [
            arena[p.arena_offset : p.arena_offset + p.length]
            if p.arena_offset is not None
            else memoryview(bytearray(p.length))
            for p in block.pieces
        ]
        return ReadBuffer(views=views, release=_noop)


class CudaTarget(Target):
    """Reads land in pinned staging buffers and are copied to the GPU on per-reader streams."""

    def __init__(self, plan: LoadPlan, device: torch.device, ring: StagingRing, readers: int) -> None:
        super().__init__(device, [torch.empty(f.arena_size, dtype=torch.uint8, device=device) for f in plan.files])
        self._ring = ring
        self._streams = [torch.cuda.Stream(device=device) for _ in range(readers)]  # type: ignore[no-untyped-call]
        # The arenas were allocated on the current stream, possibly reusing memory that queued work
        # on it still reads: the copy streams must not write before that work is done.
        current = torch.cuda.current_stream(device)
        for stream in self._streams:
            stream.wait_stream(current)

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """A staging buffer from the ring (waiting for one to be free)."""
        assert block.length <= self._ring.size, (block.length, self._ring.size)
        staging = self._ring.acquire(cancelled)
        if staging is None:
            return None
        ring = self._ring
        return ReadBuffer(
            views=[staging.memory[: block.length]], release=lambda: ring.release(staging), staging=staging
        )

    def after_read(self, reader: int, file: int, block: Block, buf: ReadBuffer) -> torch.cuda.Event | None:
        """Queue the piece copies on this reader's stream; the event also guards the buffer."""
        assert buf.staging is not None
        stream = self._streams[reader]
        arena = self.arenas[file]
        source = buf.staging.tensor
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for piece in block.pieces:
                if piece.arena_offset is None:
                    continue
                rel = piece.start - block.start
                arena[piece.arena_offset : piece.arena_offset + piece.length].copy_(
                    source[rel : rel + piece.length], non_blocking=True
                )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        buf.staging.event = event
        return event

    def tensor(self, slot: TensorSlot, dtype: torch.dtype, events: list[torch.cuda.Event]) -> torch.Tensor:
        """The slot's tensor, with the caller's stream made to wait for its copies."""
        current = torch.cuda.current_stream(self.device)
        for event in events:
            current.wait_event(event)
        return super().tensor(slot, dtype, events)

    def finish(self) -> None:
        """Wait for every copy stream, so arenas and staging buffers are idle."""
        for stream in self._streams:
            stream.synchronize()


class MappedTarget(Target):
    """CPU tensors that are views of copy-on-write mappings of the files (zero-copy)."""

    def __init__(self, plan: LoadPlan, files: Sequence[OpenFile]) -> None:
        self._maps = [
            mmap.mmap(f.fd, f.entry.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if f.entry.size
            else None
            for f in files
        ]
        # The tensors keep the mappings alive; writes to them (copy-on-write) never reach the file.
        super().__init__(
            torch.device("cpu"),
            [
                torch.frombuffer(m, dtype=torch.uint8) if m is not None else torch.empty(0, dtype=torch.uint8)
                for m in self._maps
            ],
        )
        self._memory = [memoryview(m) if m is not None else memoryview(b"") for m in self._maps]

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """The mapped bytes of the block itself."""
        return ReadBuffer(views=[self._memory[file][block.start : block.end]], release=_noop)

    def fill(self, file: int, opened: OpenFile, block: Block, buf: ReadBuffer) -> None:
        """Fault the block's pages in from the page cache (or disk) without copying them."""
        mapping = self._maps[file]
        assert mapping is not None
        start = block.start - block.start % mmap.PAGESIZE
        try:
            mapping.madvise(_MADV_POPULATE_READ, start, block.end - start)
        except OSError:  # kernels before 5.14: hashing or first use faults the pages in
            mapping.madvise(mmap.MADV_WILLNEED, start, block.end - start)

    def tensor(self, slot: TensorSlot, dtype: torch.dtype, events: list[torch.cuda.Event]) -> torch.Tensor:
        """A view at the tensor's own offset in its file."""
        return self._view(slot.file, slot.start, slot, dtype)
