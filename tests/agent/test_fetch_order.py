"""Fetch order while a local server streams the version: first layers first, rarest first within a window."""

from __future__ import annotations

import random

import pytest

from agent.fetcher import _Pool
from agent.staging import ChunkJob, Placement

pytestmark = pytest.mark.timeout(10)


def _jobs(count: int) -> list[ChunkJob]:
    jobs = [ChunkJob(digest=f"{i:064x}", length=1, blob="b", placements=[Placement(0, i, i)]) for i in range(count)]
    random.Random(3).shuffle(jobs)  # as a node with peers starts: its own random order
    return jobs


async def _order(pool: _Pool) -> list[int]:
    taken: list[int] = []
    while (job := await pool.take()) is not None:
        taken.append(job.placements[0].chunk)
        pool.done()
    return taken


async def test_a_streamed_version_is_fetched_in_file_order() -> None:
    pool = _Pool(_jobs(20), None, 0.0, in_order=lambda: True, window=4)
    assert await _order(pool) == list(range(20))


async def test_a_streamed_version_takes_the_rarest_chunk_of_the_next_window_only() -> None:
    async def rarest_is_highest(pending: list[ChunkJob]) -> bool:
        pending.sort(key=lambda j: -j.placements[0].chunk)  # pretend higher chunks are rarer
        return True

    pool = _Pool(_jobs(12), rarest_is_highest, 0.0, in_order=lambda: True, window=4)
    first = (await pool.take(), await pool.take())
    assert [j.placements[0].chunk for j in first if j is not None] == [3, 4]


async def test_without_a_streaming_reader_the_order_is_the_rankers() -> None:
    async def rarest_is_highest(pending: list[ChunkJob]) -> bool:
        pending.sort(key=lambda j: -j.placements[0].chunk)
        return True

    pool = _Pool(_jobs(12), rarest_is_highest, 0.0, in_order=lambda: False, window=4)
    assert await _order(pool) == list(range(11, -1, -1))
