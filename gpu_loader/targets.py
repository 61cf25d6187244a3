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
import numpy.typing as npt
import torch

from gpu_loader.errors import FileMismatchError
from gpu_loader.plan import Block, LoadPlan, Piece, TensorSlot
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
    """Memory one block is read into (views tiling the block, in order) and how to give it back.

    ``scratch`` is memory indexed by the offset within the block where pieces that do not land in
    an arena (hashed only, or cast on arrival) are.
    """

    views: list[memoryview]
    release: Callable[[], None]
    staging: StagingBuffer | None = None
    scratch: memoryview | None = None


class Target:
    """Common part: arenas, the outputs of tensors cast on arrival, and typed tensor views.

    ``dtypes`` holds, per slot, the dtype it is stored in and the one it is handed out in.
    """

    def __init__(
        self,
        device: torch.device,
        plan: LoadPlan,
        arenas: list[torch.Tensor],
        dtypes: Sequence[tuple[torch.dtype, torch.dtype]],
    ) -> None:
        self.device = device
        self.plan = plan
        self.arenas = arenas
        self._dtypes = dtypes
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        #: Tensors cast on arrival, allocated in the dtype they are handed out in.
        self.outputs: dict[int, torch.Tensor] = {
            index: torch.empty(slot.shape, dtype=dtypes[index][1], device=device)
            for index, slot in enumerate(plan.slots)
            if slot.cast
        }
        self._flat = {index: out.view(-1) for index, out in self.outputs.items()}

    def start_reader(self) -> None:
        """Called first in each reader thread."""

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """Memory to read ``block`` into; ``None`` when the load was cancelled while waiting."""
        raise NotImplementedError

    def fill(self, file: int, opened: OpenFile, block: Block, buf: ReadBuffer) -> None:
        """Bring the block's bytes into ``buf``."""
        read_into(opened.fd, buf.views, block.start, opened.entry.path)

    def after_read(self, reader: int, file: int, block: Block, buf: ReadBuffer) -> torch.cuda.Event | None:
        """Move the block on towards the device (here: cast what is cast); an event for when it is there."""
        if buf.scratch is not None:
            for piece in block.pieces:
                if piece.cast_slot is not None:
                    rel = piece.start - block.start
                    self._cast(piece, torch.frombuffer(buf.scratch[rel : rel + piece.length], dtype=torch.uint8))
        return None

    def _cast(self, piece: Piece, source: torch.Tensor) -> None:
        """Cast ``source`` (the piece's stored bytes) into its place in the slot's output."""
        assert piece.cast_slot is not None
        slot = self.plan.slots[piece.cast_slot]
        stored = self._dtypes[piece.cast_slot][0]
        first = (piece.start - slot.start) // stored.itemsize
        self._flat[piece.cast_slot][first : first + piece.length // stored.itemsize].copy_(source.view(stored))

    def tensor(self, index: int, dtype: torch.dtype, events: list[torch.cuda.Event]) -> torch.Tensor:
        """Slot ``index``'s tensor (its bytes complete), usable on the caller's current stream.

        It is in ``dtype`` (the stored one) unless the slot was cast on arrival.
        """
        slot = self.plan.slots[index]
        if slot.cast:
            return self._hand_out(index)
        return self._view(slot.file, slot.arena_offset, slot, dtype)

    def _hand_out(self, index: int) -> torch.Tensor:
        # The target keeps no reference to a cast output it handed out: the caller owns its memory.
        del self._flat[index]
        return self.outputs.pop(index)

    def _view(self, file: int, offset: int, slot: TensorSlot, dtype: torch.dtype) -> torch.Tensor:
        size = dtype.itemsize
        if offset % size:  # unaligned in the file (old writers, mapped): a copy makes a typed view possible
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


def _scratch_ring(plan: LoadPlan, count: int, block_size: int) -> StagingRing | None:
    """A bounded ring for the pieces of ``plan`` that land in no arena; ``None`` if there are none."""
    if any(p.arena_offset is None for item in plan.items for b in item.blocks for p in b.pieces):
        return StagingRing(count, block_size, pinned=False)
    return None


def _aligned_arena(size: int, align: int) -> tuple[npt.NDArray[np.uint8], torch.Tensor]:
    """A fresh CPU arena of ``size`` bytes whose first byte is ``align``-aligned."""
    # numpy asks the kernel for transparent huge pages on large allocations (torch's CPU
    # allocator does not): 512 times fewer first-touch page faults while preadv fills them. It
    # aligns only to 16 bytes, hence the slack.
    raw = np.empty(size + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    array = raw[skip : skip + size]
    return array, torch.from_numpy(array)


class CpuTarget(Target):
    """Reads land in the final CPU tensors' memory (cast tensors: bounded scratch, then the cast)."""

    def __init__(
        self,
        plan: LoadPlan,
        dtypes: Sequence[tuple[torch.dtype, torch.dtype]],
        *,
        align: int,
        scratch_buffers: int,
        block_size: int,
    ) -> None:
        arenas = [_aligned_arena(f.arena_size, align) for f in plan.files]
        super().__init__(torch.device("cpu"), plan, [t for _a, t in arenas], dtypes)
        self._memory = [a.data.cast("B") for a, _t in arenas]
        self._scratch = _scratch_ring(plan, scratch_buffers, block_size)

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """Views of the arena where pieces land, a scratch buffer's where they are hashed or cast."""
        arena = self._memory[file]
        ring = self._scratch
        if ring is None or all(p.arena_offset is not None for p in block.pieces):
            views = [arena[p.arena_offset : p.arena_offset + p.length] for p in block.pieces if p.arena_offset is not None]
            return ReadBuffer(views=views, release=_noop)
        staging = ring.acquire(cancelled)
        if staging is None:
            return None
        scratch = staging.memory
        views = [
            arena[p.arena_offset : p.arena_offset + p.length]
            if p.arena_offset is not None
            else scratch[p.start - block.start : p.start - block.start + p.length]
            for p in block.pieces
        ]
        return ReadBuffer(views=views, release=lambda: ring.release(staging), scratch=scratch)


class CudaTarget(Target):
    """Reads land in pinned staging buffers and are copied to the GPU on per-reader streams.

    Build it under ``torch.cuda.device(device)``, so nothing touches another GPU.
    """

    def __init__(
        self,
        plan: LoadPlan,
        dtypes: Sequence[tuple[torch.dtype, torch.dtype]],
        device: torch.device,
        ring: StagingRing,
        readers: int,
    ) -> None:
        super().__init__(
            device, plan, [torch.empty(f.arena_size, dtype=torch.uint8, device=device) for f in plan.files], dtypes
        )
        self._ring = ring
        self._streams = [torch.cuda.Stream(device=device) for _ in range(readers)]  # type: ignore[no-untyped-call]
        # The arenas were allocated on the current stream, possibly reusing memory that queued work
        # on it still reads: the copy streams must not write before that work is done.
        current = torch.cuda.current_stream(device)
        for stream in self._streams:
            stream.wait_stream(current)
        # Where cast pieces land on the device before their cast: one block per reader, used only
        # on that reader's stream, so stream order alone keeps reuse safe.
        self._cast_scratch: list[torch.Tensor | None] = [None] * readers

    def start_reader(self) -> None:
        """Make the load's GPU this thread's current device: no CUDA call a reader makes (a fence
        wait included) may fall back to device 0 and create a context there."""
        torch.cuda.set_device(self.device)

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
        """Queue the piece copies (and casts) on this reader's stream; the event also fences the buffer.

        The event is recorded whatever happens: a copy that raises after earlier ones were queued
        must still keep the buffer from being refilled while the copy engine reads it.
        """
        assert buf.staging is not None
        stream = self._streams[reader]
        arena = self.arenas[file]
        source = buf.staging.tensor
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            try:
                for piece in block.pieces:
                    rel = piece.start - block.start
                    if piece.cast_slot is not None:
                        landing = self._landing(reader)[: piece.length]
                        landing.copy_(source[rel : rel + piece.length], non_blocking=True)
                        self._cast(piece, landing)
                    elif piece.arena_offset is not None:
                        arena[piece.arena_offset : piece.arena_offset + piece.length].copy_(
                            source[rel : rel + piece.length], non_blocking=True
                        )
            finally:
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(stream)
                buf.staging.event = event
        return event

    def _landing(self, reader: int) -> torch.Tensor:
        landing = self._cast_scratch[reader]
        if landing is None:
            # Allocated on the reader's stream, so the caching allocator ties it to that stream.
            landing = torch.empty(self._ring.size, dtype=torch.uint8, device=self.device)
            self._cast_scratch[reader] = landing
        return landing

    def tensor(self, index: int, dtype: torch.dtype, events: list[torch.cuda.Event]) -> torch.Tensor:
        """The slot's tensor, with the caller's stream made to wait for its copies."""
        current = torch.cuda.current_stream(self.device)
        for event in events:
            current.wait_event(event)
        return super().tensor(index, dtype, events)

    def finish(self) -> None:
        """Wait for every copy stream, so arenas and staging buffers are idle."""
        for stream in self._streams:
            stream.synchronize()
        self._cast_scratch = [None] * len(self._cast_scratch)


class MappedTarget(Target):
    """CPU tensors that are views of copy-on-write mappings of the files (zero-copy)."""

    def __init__(
        self, plan: LoadPlan, files: Sequence[OpenFile], dtypes: Sequence[tuple[torch.dtype, torch.dtype]]
    ) -> None:
        self._maps = [
            mmap.mmap(f.fd, f.entry.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if f.entry.size
            else None
            for f in files
        ]
        # The tensors keep the mappings alive; writes to them (copy-on-write) never reach the file.
        super().__init__(
            torch.device("cpu"),
            plan,
            [
                torch.frombuffer(m, dtype=torch.uint8) if m is not None else torch.empty(0, dtype=torch.uint8)
                for m in self._maps
            ],
            dtypes,
        )
        self._memory = [memoryview(m) if m is not None else memoryview(b"") for m in self._maps]

    def buffer(self, file: int, block: Block, cancelled: Event) -> ReadBuffer | None:
        """The mapped bytes of the block itself."""
        view = self._memory[file][block.start : block.end]
        return ReadBuffer(views=[view], release=_noop, scratch=view)

    def fill(self, file: int, opened: OpenFile, block: Block, buf: ReadBuffer) -> None:
        """Fault the block's pages in from the page cache (or disk) without copying them."""
        mapping = self._maps[file]
        assert mapping is not None
        start = block.start - block.start % mmap.PAGESIZE
        try:
            mapping.madvise(_MADV_POPULATE_READ, start, block.end - start)
        except OSError:  # kernels before 5.14: hashing or first use faults the pages in
            mapping.madvise(mmap.MADV_WILLNEED, start, block.end - start)

    def tensor(self, index: int, dtype: torch.dtype, events: list[torch.cuda.Event]) -> torch.Tensor:
        """A view at the tensor's own offset in its file (or its cast output)."""
        slot = self.plan.slots[index]
        if slot.cast:
            return self._hand_out(index)
        return self._view(slot.file, slot.start, slot, dtype)
