"""Buffers for reading files: a fixed pool of them, and the one way to fill one exactly.

``BufferPool`` hands out at most ``count`` buffers of ``size`` bytes; a thread that asks for one
while all are out waits until one comes back. Hashing a model directory uses one pool for the
whole job, so its memory is ``count x size`` whatever the number of cores, readers and files
(``chunks.hash_files``). Buffers are allocated on first use, so a small job stays small.

``read_exact`` fills a buffer from a file at an offset across short reads (``preadv`` may return
less than asked, at most ~2 GiB per call on Linux), and says clearly when the file ends early.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from weightship.errors import IntegrityError

__all__ = ["BufferPool", "read_exact"]


def read_exact(fd: int, view: memoryview, offset: int, name: str = "the file") -> None:
    """Fill all of ``view`` with the bytes of ``fd`` from ``offset``.

    Raises ``IntegrityError`` naming ``name`` when the file ends first: it is shorter than the
    caller was promised (truncated, or changed while being read).
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise IntegrityError(
                f"{name} ended at byte {offset + done}, {len(view) - done} bytes short of the "
                f"{len(view)} expected at offset {offset}: it was truncated or changed while being read; "
                "leave it alone and try again"
            )
        done += n


class BufferPool:
    """At most ``count`` reusable ``bytearray`` buffers of ``size`` bytes, shared by threads."""

    def __init__(self, count: int, size: int) -> None:
        if count < 1 or size < 1:
            raise ValueError(f"a buffer pool needs at least one buffer of at least one byte, not {count} x {size}")
        self.count = count
        self.size = size
        self._free: list[bytearray] = []
        self._allocated = 0
        self._in_use = 0
        self._peak = 0
        self._cond = threading.Condition()

    @classmethod
    def within(cls, memory: int, size: int, wanted: int) -> BufferPool:
        """A pool of ``wanted`` buffers of ``size``, fewer if they would take more than ``memory``.

        Never fewer than one buffer, so a single chunk larger than ``memory`` can still be read.
        """
        return cls(max(1, min(wanted, memory // max(1, size))), size)

    def acquire(self) -> bytearray:
        """A buffer; waits while all ``count`` are out."""
        with self._cond:
            while not self._free and self._allocated >= self.count:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                buf = bytearray(self.size)
                self._allocated += 1
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
            return buf

    def release(self, buf: bytearray) -> None:
        """Give ``buf`` back (it must have come from ``acquire``)."""
        with self._cond:
            self._in_use -= 1
            self._free.append(buf)
            self._cond.notify()

    @contextmanager
    def buffer(self) -> Iterator[bytearray]:
        """``acquire`` for the span of a ``with`` block."""
        buf = self.acquire()
        try:
            yield buf
        finally:
            self.release(buf)

    @property
    def allocated(self) -> int:
        """Buffers created so far (never more than ``count``)."""
        return self._allocated

    @property
    def in_use(self) -> int:
        """Buffers handed out and not yet released."""
        return self._in_use

    @property
    def peak(self) -> int:
        """The most buffers that were out at once."""
        return self._peak
