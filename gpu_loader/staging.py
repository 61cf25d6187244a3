"""A ring of host buffers that reads land in before they go on: to a GPU, or to a cast.

On a GPU host the buffers are pinned (page-locked), because only pinned memory lets the copy
engine run while the reader reads on. Pinning is slow (``cudaHostAlloc`` and page locking), so a
``Loader`` builds one ring and shares it between every load and every device: pinned memory is
portable across devices under unified addressing. Each buffer is its own allocation of exactly
the block size: torch's host allocator rounds every allocation up to a power of two, so one
``count x size`` allocation could pin nearly twice what is used, where a power-of-two block size
(the default 16 MiB) pins exactly ``count x size``. ``close`` gives the memory back to the system,
not just to torch's cache.

On the CPU the same ring, unpinned and per load, bounds the scratch that bytes only hashed or
cast on arrival pass through: readers wait for a buffer instead of allocating without limit while
hashing lags behind. Its buffers are untouched until used and handed out last in, first out, so
a load faults in only as many as it has in use at once, not the whole ring.

A buffer goes back to the ring when its hash is done; the next reader to take it first waits
for the CUDA event (the *fence*) of the copy that last read it, so copies and reads overlap and a
buffer is never overwritten while the copy engine still reads it. The events are blocking ones:
a reader waiting for a copy sleeps instead of spinning a core.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

__all__ = ["StagingBuffer", "StagingRing", "pinned_allocation_size"]


def pinned_allocation_size(size: int) -> int:
    """Bytes torch's host allocator pins for a request of ``size`` (the next power of two)."""
    return 1 << max(0, size - 1).bit_length()


class StagingBuffer:
    """One buffer of the ring, and the fence of the last copy that read it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.memory = tensor.numpy().data.cast("B")
        self.event: torch.cuda.Event | None = None


class StagingRing:
    """``count`` buffers of ``size`` bytes each (pinned or not), handed out and returned by threads."""

    def __init__(self, count: int, size: int, *, pinned: bool) -> None:
        self.size = size
        self.count = count
        self.pinned = pinned
        self._buffers = [StagingBuffer(self._allocate(size, pinned)) for _ in range(count)]
        # Pinned: first in, first out, so the buffer taken is the one whose copy is likeliest done.
        # Plain (CPU scratch): last in, first out, so loads reuse the buffers already touched and
        # the others are never faulted in (a trusted casting load touches one per reader).
        self._free: queue.SimpleQueue[StagingBuffer] | queue.LifoQueue[StagingBuffer] = (
            queue.SimpleQueue() if pinned else queue.LifoQueue()
        )
        for buffer in self._buffers:
            self._free.put(buffer)

    @staticmethod
    def _allocate(size: int, pinned: bool) -> torch.Tensor:
        if pinned:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        # numpy's allocation is untouched until used: a buffer that only ever holds a header costs
        # one page of memory, not ``size``.
        return torch.from_numpy(np.empty(size, dtype=np.uint8))

    @property
    def nbytes(self) -> int:
        """Bytes this ring holds (pinned: what the host allocator pinned for it)."""
        each = pinned_allocation_size(self.size) if self.pinned else self.size
        return each * len(self._buffers)

    def free_count(self) -> int:
        """Buffers in the ring right now (all of them between loads)."""
        return self._free.qsize()

    def acquire(self, cancelled: threading.Event) -> StagingBuffer | None:
        """A free buffer whose last copy has finished; ``None`` once ``cancelled`` is set."""
        while not cancelled.is_set():
            try:
                buffer = self._free.get(timeout=0.05)
            except queue.Empty:
                continue
            if buffer.event is not None:
                buffer.event.synchronize()
                buffer.event = None
            return buffer
        return None

    def release(self, buffer: StagingBuffer) -> None:
        """Give a buffer back; its pending copy (if any) is waited for by the next taker."""
        self._free.put(buffer)

    def drain(self) -> None:
        """Wait for every copy that read from the ring (before the ring is freed)."""
        for buffer in self._buffers:
            event = buffer.event
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        """Wait for the copies, then free the buffers; pinned memory goes back to the system."""
        self.drain()
        self._buffers.clear()
        while True:
            try:
                self._free.get_nowait()
            except queue.Empty:
                break
        if self.pinned:
            # torch's host allocator caches freed pinned blocks for reuse: hand them back for real.
            torch.accelerator.empty_host_cache()
