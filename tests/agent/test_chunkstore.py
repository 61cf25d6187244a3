"""The cache's chunk store on a real directory: crash-safe names, LRU eviction, pinned chunks kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.chunkstore import ChunkStore
from weightship.digests import sha256_hex

pytestmark = pytest.mark.timeout(30)


def _chunk(n: int, size: int = 1000) -> tuple[str, bytes]:
    data = bytes([n]) * size
    return sha256_hex(data), data


def test_least_recently_used_unpinned_chunks_are_evicted_first(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, capacity=3000)
    (a, da), (b, db), (c, dc), (d, dd) = (_chunk(i) for i in range(4))
    for digest, data in ((a, da), (b, db), (c, dc)):
        store.put(digest, data, pinned=set())
    assert store.get(a) == 1000  # a is now the most recently used; b the least
    store.put(d, dd, pinned=set())
    assert store.get(b) is None
    assert not store.path(b).exists()
    assert {x for x in (a, c, d) if store.get(x)} == {a, c, d}


def test_pinned_chunks_survive_eviction_even_when_least_recently_used(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, capacity=2000)
    (a, da), (b, db), (c, dc) = (_chunk(i) for i in range(3))
    store.put(a, da, pinned={a})
    store.put(b, db, pinned={a})
    store.put(c, dc, pinned={a})
    assert store.get(a) == 1000
    assert store.get(b) is None
    assert store.get(c) == 1000
    # Everything pinned and full: the new chunk is still kept (a pointer's versions stay servable).
    e, de = _chunk(9)
    store.put(e, de, pinned={a, c, e})
    assert store.used == 3000


def test_a_restarted_store_keeps_whole_chunks_and_drops_leftover_temporary_files(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, capacity=0)
    a, da = _chunk(1)
    store.put(a, da, pinned=set())
    leftover = store.path(a).parent / f".{a}.dead.tmp"  # a write a kill -9 cut short
    leftover.write_bytes(b"partial")
    stranger = store.path(a).parent / "not-a-digest"
    stranger.write_bytes(b"x")
    again = ChunkStore(tmp_path, capacity=0)
    assert again.recover() == 1
    assert again.get(a) == 1000
    assert store.path(a).read_bytes() == da
    assert not leftover.exists()
    assert not stranger.exists()
