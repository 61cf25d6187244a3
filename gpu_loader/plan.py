"""The load plan: which bytes to read, where each lands, and which reads make each tensor whole.

Planning works on byte ranges, not tensors. For each weight file the tensors a load needs (a
rank's rows under tensor parallelism) are sorted by offset and merged into *runs* of adjacent
bytes. Each file gets one *arena* (a flat byte buffer on the target device) holding its runs
back to back; a tensor is a view into its file's arena. Every tensor starts at a multiple of the
plan's ``align`` in its arena (256 bytes for a GPU, 64 for the CPU), whatever its offset in the
file: safetensors pads the header only to 8 bytes, so file offsets say little. A tensor that would
land unaligned at the end of the previous run starts a new run instead.

When a load casts, each floating tensor whose elements cannot straddle a block (its file offset,
the chunk size and the block size are multiples of its item size, true of any file written by a
current safetensors) gets no arena space: its pieces are read into bounded scratch and cast on
arrival into the tensor's own output in the target dtype, so the stored-dtype bytes never pile up
beside the cast copies.

The unit of work is an *item*, read by one reader thread:

* when chunks are verified (``full`` / ``fast``), an item is one manifest chunk, read whole
  because its digest covers every byte of it; bytes no tensor needs (the header, other ranks'
  rows) are read into scratch only to be hashed;
* with ``trust`` an item is a piece of a run of at most ``block_size`` bytes, so only needed bytes
  are read.

An item is read as *blocks* of at most ``block_size`` bytes (one staging buffer each); a block is
a list of *pieces*, each landing in the arena or in scratch. A tensor is ready when every item
that touches it is done.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpu_loader.sharding import ShardSpec, tensor_range
from weightship.chunks import chunk_count
from weightship.manifest import FileEntry
from weightship.safetensors_header import TensorInfo

__all__ = ["CPU_ALIGN", "CUDA_ALIGN", "Block", "FilePlan", "Item", "LoadPlan", "Piece", "TensorSlot", "make_plan"]

#: Byte alignment of every tensor in an owned arena: a cache line on CPU, and on a GPU the
#: alignment the caching allocator gives each tensor of its own (vectorised kernels rely on it).
CPU_ALIGN = 64
CUDA_ALIGN = 256


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor (or one rank's rows of it) lands."""

    name: str
    file: int
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int
    arena_offset: int
    #: Cast on arrival into a tensor of its own (no arena space; ``arena_offset`` is meaningless).
    cast: bool = False


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, start + length)`` of a file, landing at ``arena_offset`` (``None``: scratch).

    ``cast_slot`` names the slot whose bytes these are when they are cast on arrival: they are read
    into scratch (``arena_offset`` is ``None``) and cast into that slot's output.
    """

    start: int
    length: int
    arena_offset: int | None
    cast_slot: int | None = None


@dataclass(frozen=True, slots=True)
class Block:
    """One read call's worth of bytes: contiguous in the file, split into pieces by destination."""

    start: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def length(self) -> int:
        """Bytes in the block."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Item:
    """A unit of work for one reader: a chunk (verified loads) or a run piece (trusted loads)."""

    file: int
    start: int
    end: int
    chunk: int | None
    blocks: tuple[Block, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FilePlan:
    """A weight file in the plan and the size of its arena."""

    entry: FileEntry
    arena_size: int


@dataclass(frozen=True)
class LoadPlan:
    """Everything a load reads and where it goes."""

    files: tuple[FilePlan, ...]
    slots: tuple[TensorSlot, ...]
    items: tuple[Item, ...]
    chunked: bool

    @property
    def bytes_read(self) -> int:
        """Bytes the load reads from disk."""
        return sum(i.end - i.start for i in self.items)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data the load hands out (before any cast)."""
        return sum(s.nbytes for s in self.slots)


@dataclass(slots=True)
class _Run:
    start: int
    end: int
    arena_offset: int = 0
    cast_slot: int | None = None


def _runs(ranges: list[tuple[int, int, int | None]], align: int) -> list[_Run]:
    """Runs of adjacent ``(start, end, cast_slot)`` byte ranges, each tensor aligned in the arena.

    A range joins the run before it when it is adjacent and would land aligned there; cast ranges
    never join (they land in their own output) and take no arena space.
    """
    runs: list[_Run] = []
    cursor = 0
    last: _Run | None = None  # the run the next arena range may extend
    for start, end, cast_slot in sorted(r for r in ranges if r[1] > r[0]):
        if cast_slot is not None:
            runs.append(_Run(start, end, 0, cast_slot))
            continue
        if last is not None and last.end == start and (last.arena_offset + start - last.start) % align == 0:
            last.end = end
        else:
            last = _Run(start, end, -(-cursor // align) * align)
            runs.append(last)
        cursor = last.arena_offset + last.end - last.start
    return runs


def _pieces(runs: list[_Run], starts: list[int], start: int, end: int) -> list[Piece]:
    """Pieces tiling ``[start, end)``: arena pieces where runs cover it, scratch elsewhere."""
    pieces: list[Piece] = []
    cursor = start
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while cursor < end:
        run = runs[i] if i < len(runs) else None
        if run is None or run.start >= end:
            pieces.append(Piece(cursor, end - cursor, None))
            break
        if run.end <= cursor:
            i += 1
            continue
        if run.start > cursor:
            pieces.append(Piece(cursor, run.start - cursor, None))
            cursor = run.start
        stop = min(run.end, end)
        if run.cast_slot is not None:
            pieces.append(Piece(cursor, stop - cursor, None, run.cast_slot))
        else:
            pieces.append(Piece(cursor, stop - cursor, run.arena_offset + cursor - run.start))
        cursor = stop
        i += 1
    return pieces


def _blocks(pieces: list[Piece], start: int, end: int, block_size: int) -> tuple[Block, ...]:
    blocks: list[Block] = []
    queue = deque(pieces)
    for b_start in range(start, end, block_size):
        b_end = min(b_start + block_size, end)
        inside: list[Piece] = []
        while queue and queue[0].start < b_end:
            piece = queue.popleft()
            stop = min(piece.start + piece.length, b_end)
            inside.append(Piece(piece.start, stop - piece.start, piece.arena_offset, piece.cast_slot))
            if stop < piece.start + piece.length:
                rest_offset = None if piece.arena_offset is None else piece.arena_offset + stop - piece.start
                queue.appendleft(Piece(stop, piece.start + piece.length - stop, rest_offset, piece.cast_slot))
        blocks.append(Block(b_start, b_end, tuple(inside)))
    return tuple(blocks)


def make_plan(
    files: Sequence[tuple[FileEntry, Sequence[TensorInfo]]],
    *,
    shard: ShardSpec | None,
    chunk_size: int,
    chunked: bool,
    block_size: int,
    align: int = CPU_ALIGN,
    cast_itemsize: Callable[[str], int | None] | None = None,
) -> LoadPlan:
    """Plan a load of the given tensors of each file.

    ``chunked`` reads whole manifest chunks so that each can be verified; otherwise only the
    needed bytes are read. ``cast_itemsize`` maps a safetensors dtype to its item size when the
    load casts tensors of that dtype (``None`` when it keeps them).
    """
    file_plans: list[FilePlan] = []
    all_slots: list[TensorSlot] = []
    items: list[Item] = []
    for file_index, (entry, tensors) in enumerate(files):
        assert entry.safetensors is not None, entry.path
        data_start = entry.safetensors.data_start
        needed = [tensor_range(info, shard, entry.path) for info in tensors]
        base = len(all_slots)
        ranges_wanted: list[tuple[int, int, int | None]] = []
        for i, (info, rng) in enumerate(zip(tensors, needed, strict=True)):
            size = cast_itemsize(info.dtype) if cast_itemsize is not None else None
            start = data_start + rng.begin
            # Cast piece by piece only where no element can straddle a block or chunk boundary.
            cast = size is not None and start % size == block_size % size == chunk_size % size == 0
            ranges_wanted.append((start, data_start + rng.end, base + i if cast else None))
        runs = _runs(ranges_wanted, align)
        starts = [r.start for r in runs]
        placed: list[TensorSlot] = []
        for info, rng, (start, _end, cast_slot) in zip(tensors, needed, ranges_wanted, strict=True):
            nbytes, offset = rng.end - rng.begin, 0
            if nbytes and cast_slot is None:
                run = runs[bisect.bisect_right(starts, start) - 1]
                offset = run.arena_offset + start - run.start
            cast = cast_slot is not None and nbytes > 0
            placed.append(TensorSlot(info.name, file_index, info.dtype, rng.shape, start, nbytes, offset, cast))
        arena_size = max((r.arena_offset + r.end - r.start for r in runs if r.cast_slot is None), default=0)
        file_plans.append(FilePlan(entry, arena_size))

        ranges: list[tuple[int, int, int | None]] = []
        if chunked:
            wanted: set[int] = set()
            for run in runs:
                wanted.update(range(run.start // chunk_size, (run.end - 1) // chunk_size + 1))
            assert all(c < chunk_count(entry.size, chunk_size) for c in wanted)
            ranges = [(*entry.chunk_range(c, chunk_size), c) for c in sorted(wanted)]
        else:
            for run in runs:
                ranges.extend((s, min(s + block_size, run.end), None) for s in range(run.start, run.end, block_size))
        item_starts = [r[0] for r in ranges]
        touching: list[list[int]] = [[] for _ in ranges]
        for i, slot in enumerate(placed):
            if slot.nbytes:
                first = bisect.bisect_right(item_starts, slot.start) - 1
                last = bisect.bisect_left(item_starts, slot.start + slot.nbytes) - 1
                for k in range(first, last + 1):
                    touching[k].append(base + i)
        for (start, end, chunk), slot_ids in zip(ranges, touching, strict=True):
            pieces = _pieces(runs, starts, start, end)
            items.append(Item(file_index, start, end, chunk, _blocks(pieces, start, end, block_size), tuple(slot_ids)))
        all_slots.extend(placed)
    return LoadPlan(files=tuple(file_plans), slots=tuple(all_slots), items=tuple(items), chunked=chunked)
