"""A reusable ring of pinned host buffers that reads land in before their copy to a GPU.

Pinning memory is slow (it is a ``cudaHostAlloc`` and page locking), so a ``Loader`` allocates
the ring once per device, as one pinned allocation cut into equal buffers, and reuses it for
every load. A buffer goes back to the ring when its hash is done; the next reader to take it
first waits for the CUDA event of the copy that last read it, so copies and reads overlap and a
buffer is never overwritten while the copy engine still reads it.
"""

from __future__ import annotations

import queue
import threading

import torch

__all__ = ["StagingBuffer", "StagingRing"]


class StagingBuffer:
    """One pinned buffer of the ring."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.memory = tensor.numpy().data.cast("B")
        self.event: torch.cuda.Event | None = None


class StagingRing:
    """``count`` pinned buffers of ``size`` bytes each, handed out and returned by threads."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._backing = torch.empty(count * size, dtype=torch.uint8, pin_memory=True)
        self._buffers = [StagingBuffer(self._backing[i * size : (i + 1) * size]) for i in range(count)]
        self._free: queue.SimpleQueue[StagingBuffer] = queue.SimpleQueue()
        for buffer in self._buffers:
            self._free.put(buffer)
        self.count = count

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
