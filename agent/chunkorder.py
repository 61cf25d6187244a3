"""A version's chunk numbering, shared by announcers, the tracker and the fetcher.

Chunks of a version are numbered by ``chunk_order`` (distinct chunk digests, first seen first);
announcements carry a have-bitmap over those numbers (``bitmap_of`` / ``indexes_of``), and a node
picks the next chunk to ask for from what it sees of the cluster (``Availability``, ``rank_chunks``,
``obtainable``). ``agent.tracker`` keeps the holdings; this module only numbers and orders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightship.errors import ValidationError
from weightship.manifest import Manifest

__all__ = ["Availability", "bitmap_of", "chunk_order", "indexes_of", "obtainable", "rank_chunks"]


@dataclass(frozen=True)
class Availability:
    """A version's chunks as one node sees the cluster: what to ask for next (``rank_chunks``)."""

    #: per chunk index: live peers holding it (not the asker)
    holders: tuple[int, ...]
    #: chunk indexes some node is fetching from the tier above right now (a peer will have them soon)
    fetching: frozenset[int] = frozenset()
    #: chunk indexes the cluster cache holds (filled in by the cache, not the pure tracker)
    cached: frozenset[int] = frozenset()
    #: upstream grants free cluster-wide now
    upstream_free: int = 0
    #: per chunk index: how many of its holders are below their fan-out bound now (empty: not told)
    free: tuple[int, ...] = ()


def chunk_order(manifest: Manifest) -> list[str]:
    """A version's distinct chunk digests in first-seen order (files in order, chunks in order).

    Announcement bitmaps and ``sources`` indexes number chunks in this order.
    """
    seen: dict[str, None] = {}
    for entry in manifest.files:
        for digest in entry.chunks:
            seen.setdefault(digest, None)
    return list(seen)


def bitmap_of(indexes: Iterable[int], count: int) -> bytes:
    """The have-bitmap over ``count`` chunks: bit ``i`` (MSB first in byte ``i // 8``) set if held."""
    out = bytearray((count + 7) // 8)
    for i in indexes:
        if not 0 <= i < count:
            raise ValidationError(f"chunk index {i} is outside 0..{count - 1}")
        out[i // 8] |= 0x80 >> (i % 8)
    return bytes(out)


def rank_chunks(pending: Iterable[int], seen: Availability, salt: str) -> list[int]:
    """The order in which a node should ask for its ``pending`` chunk indexes, given ``seen``.

    1. Chunks only the cluster cache holds, while upstream grants are free, oldest first (the order
       the cache reads a version ahead): each enters the swarm through one node, so the cache's
       link (with the origin's, the scarce one) never idles, and no chunk waits there for long.
    2. Chunks a peer with a free upload slot holds, rarest first: the copies the swarm lacks most are
       made first, so the last chunks do not wait on one parent (BitTorrent's rarest-first).
    3. Chunks only busy peers hold, rarest first: asked for once a parent frees up.
    4. Chunks a node is fetching from the tier above now: a peer will hold them soon.
    5. Chunks nobody holds yet, in chunk order, the order the cache reads a version ahead, so a node
       that must go up asks for the chunk arriving next.

    Ties are broken by a hash of (``salt``, index): nodes (salted with their names) take different
    chunks among equals and have different chunks to trade early.
    """

    def key(index: int) -> tuple[int, int, bytes]:
        held = seen.holders[index] if 0 <= index < len(seen.holders) else 0
        tie = hashlib.blake2b(f"{salt}/{index}".encode(), digest_size=8).digest()
        if held == 0 and index in seen.cached and index not in seen.fetching and seen.upstream_free > 0:
            return (0, index, tie)
        if held > 0:
            return (1 if _free(index, seen) else 2, held, tie)
        if index in seen.fetching:
            return (3, 0, tie)
        return (4, index, b"")

    return sorted(pending, key=key)


def obtainable(index: int, seen: Availability) -> bool:
    """Whether asking for chunk ``index`` now can succeed: a peer with a free slot holds it, or an upstream grant is free.

    A node whose best pending chunk is not obtainable waits for news (``Availability``) instead of
    asking the tracker about chunks it would only be told to wait for.
    """
    held = seen.holders[index] if 0 <= index < len(seen.holders) else 0
    if held > 0:
        return _free(index, seen)
    return seen.upstream_free > 0 and index not in seen.fetching


def _free(index: int, seen: Availability) -> bool:
    """Whether a holder of chunk ``index`` has a free upload slot (True when the tracker did not say)."""
    if not seen.free:
        return True
    return 0 <= index < len(seen.free) and seen.free[index] > 0


def indexes_of(bitmap: bytes, count: int | None = None) -> Sequence[int]:
    """The chunk indexes a have-bitmap names; bits at or past ``count`` must be clear.

    With ``count``, the bitmap's length is checked before a bit of it is expanded: a bitmap longer
    than ``count`` chunks need costs nothing but its refusal.
    """
    if count is not None and len(bitmap) > (count + 7) // 8:
        raise ValidationError(
            f"have-bitmap is {len(bitmap)} bytes but the version has {count} chunks ({(count + 7) // 8} bytes); "
            "announce with the version's chunk order (agent.chunkorder.chunk_order)"
        )
    found = [i * 8 + b for i, byte in enumerate(bitmap) if byte for b in range(8) if byte & (0x80 >> b)]
    if count is not None and found and found[-1] >= count:
        raise ValidationError(
            f"have-bitmap names chunk {found[-1]} but the version has {count} chunks; announce with the "
            "version's chunk order (agent.chunkorder.chunk_order)"
        )
    return found
