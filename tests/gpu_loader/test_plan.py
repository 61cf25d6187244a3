"""Load plans: every needed byte lands exactly once, aligned, and readiness is tracked per item."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_loader.model import column_parallel
from gpu_loader.plan import CPU_ALIGN, CUDA_ALIGN, LoadPlan, make_plan
from gpu_loader.sharding import ShardSpec, tensor_range
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import manifest_of


def plan_for(
    version: Path, *, chunked: bool, block_size: int, shard: ShardSpec | None, align: int = CPU_ALIGN,
    cast_itemsize: Callable[[str], int | None] | None = None,
) -> LoadPlan:
    manifest = manifest_of(version)
    files = [(f, list(f.safetensors.tensors)) for f in manifest.files if f.safetensors is not None]
    return make_plan(
        files, shard=shard, chunk_size=manifest.chunk_size, chunked=chunked, block_size=block_size, align=align,
        cast_itemsize=cast_itemsize,
    )


CASES = [
    pytest.param(chunked, block, shard, id=f"{'chunked' if chunked else 'ranges'}-{block // 1024}k-{'tp' if shard else 'whole'}")
    for chunked in (True, False)
    for block in (16 * 1024, 100 * 1024, 16 * 1024 * 1024)
    for shard in (None, ShardSpec(1, 2, column_parallel))
]


@pytest.mark.parametrize(("chunked", "block", "shard"), CASES)
def test_pieces_tile_blocks_and_blocks_tile_items(versions: Versions, chunked: bool, block: int, shard: ShardSpec | None) -> None:
    plan = plan_for(versions.sharded, chunked=chunked, block_size=block, shard=shard)
    for item in plan.items:
        assert item.blocks[0].start == item.start
        assert item.blocks[-1].end == item.end
        for before, after in zip(item.blocks, item.blocks[1:], strict=False):
            assert before.end == after.start
        for b in item.blocks:
            assert b.length <= block
            assert b.pieces[0].start == b.start
            assert sum(p.length for p in b.pieces) == b.length
            for piece, following in zip(b.pieces, b.pieces[1:], strict=False):
                assert piece.start + piece.length == following.start


@pytest.mark.parametrize(("chunked", "block", "shard"), CASES)
def test_every_needed_byte_lands_once_in_its_slot(versions: Versions, chunked: bool, block: int, shard: ShardSpec | None) -> None:
    plan = plan_for(versions.sharded, chunked=chunked, block_size=block, shard=shard)
    landed: dict[int, list[tuple[int, int]]] = {}
    for item in plan.items:
        for b in item.blocks:
            for p in b.pieces:
                if p.arena_offset is not None:
                    landed.setdefault(item.file, []).append((p.arena_offset, p.arena_offset + p.length))
    for index, slot in enumerate(plan.slots):
        if not slot.nbytes:
            continue
        assert slot.arena_offset % CPU_ALIGN == 0  # whatever the file offset
        covered = sorted((max(a, slot.arena_offset), min(b, slot.arena_offset + slot.nbytes))
                         for a, b in landed[slot.file] if a < slot.arena_offset + slot.nbytes and b > slot.arena_offset)
        assert covered[0][0] == slot.arena_offset
        assert covered[-1][1] == slot.arena_offset + slot.nbytes
        assert all(x[1] == y[0] for x, y in itertools.pairwise(covered))
        touching = [i for i, item in enumerate(plan.items) if item.file == slot.file and item.start < slot.start + slot.nbytes and item.end > slot.start]
        assert touching == [i for i, item in enumerate(plan.items) if index in item.slots]


def test_trusted_plan_reads_only_the_rank_rows(versions: Versions) -> None:
    shard = ShardSpec(0, 2, column_parallel)
    plan = plan_for(versions.sharded, chunked=False, block_size=1 << 20, shard=shard)
    manifest = manifest_of(versions.sharded)
    expected = sum(
        (r := tensor_range(t, shard, f.path)).end - r.begin for f in manifest.files if f.safetensors for t in f.safetensors.tensors
    )
    assert plan.bytes_read == plan.tensor_bytes == expected


def test_chunked_plan_reads_whole_chunks(versions: Versions) -> None:
    manifest = manifest_of(versions.sharded)
    plan = plan_for(versions.sharded, chunked=True, block_size=1 << 20, shard=None)
    for item in plan.items:
        entry = plan.files[item.file].entry
        assert item.chunk is not None
        assert (item.start, item.end) == entry.chunk_range(item.chunk, manifest.chunk_size)


@pytest.mark.parametrize("align", [CPU_ALIGN, CUDA_ALIGN])
@pytest.mark.parametrize(("chunked", "block", "shard"), CASES)
def test_cast_tensors_take_no_arena_space_and_land_once_in_their_own_output(versions: Versions, chunked: bool, block: int, shard: ShardSpec | None, align: int) -> None:
    plan = plan_for(versions.sharded, chunked=chunked, block_size=block, shard=shard, align=align, cast_itemsize=lambda d: 2)
    assert all(slot.cast for slot in plan.slots if slot.nbytes)
    assert all(f.arena_size == 0 for f in plan.files)
    landed: dict[int, list[tuple[int, int]]] = {}
    for item in plan.items:
        for b in item.blocks:
            for p in b.pieces:
                assert p.arena_offset is None
                if p.cast_slot is not None:
                    assert p.cast_slot in item.slots
                    landed.setdefault(p.cast_slot, []).append((p.start, p.start + p.length))
    for index, slot in enumerate(plan.slots):
        if slot.nbytes:
            spans = sorted(landed[index])
            assert spans[0][0] == slot.start
            assert spans[-1][1] == slot.start + slot.nbytes
            assert all(x[1] == y[0] for x, y in itertools.pairwise(spans))


def test_tensors_whose_elements_could_straddle_a_block_are_not_cast_on_arrival(versions: Versions) -> None:
    plan = plan_for(versions.sharded, chunked=True, block_size=16 * 1024 + 2, shard=None, cast_itemsize=lambda d: 4)
    assert not any(slot.cast for slot in plan.slots)
