"""The served process's garbage-collection policy: keep collection pauses out of request latency.

CPython's cyclic collector walks every tracked object of the generations it collects while the
process stands still. Two populations make those walks long here:

- everything imported and built at start-up (FastAPI, pydantic and SQLAlchemy internals: hundreds
  of thousands of objects), which lives as long as the process;
- thousands of parked long-polls (a coroutine chain, a request, a connection each: about 150
  objects a poll), which live up to a wait each. A pointer change re-parks all of them at once,
  and walking 5,000 of them takes about half a second, in whichever collection they are in:
  the young generations while they are new, a full collection once a quarter more objects reach
  the old generation (which a re-park wave does every time).

So the start-up heap is frozen (``gc.freeze``: collections never walk it), and from then on
everything that has survived for ``FREEZE_SECONDS`` is frozen too, by a thread that freezes
every ``FREEZE_SECONDS`` (an O(1) call). Collections then walk at most a second's worth of new
objects. Frozen objects are still freed by reference counting when their last reference goes
(nearly all are: a finished request leaves few cycles); only reference cycles among them wait
for the full collection that runs, unfrozen, every ``FULL_COLLECTION_SECONDS`` (one pause of
about a second, ten minutes apart, which bounds what those cycles can hold).
"""

from __future__ import annotations

import gc
import threading
import time

__all__ = ["FREEZE_SECONDS", "FULL_COLLECTION_SECONDS", "GC_YOUNG_THRESHOLD", "tune"]

#: young-generation collections run every this many allocations (CPython's default: 700)
GC_YOUNG_THRESHOLD = 10_000
#: objects that survived this long are frozen (no collection walks them)
FREEZE_SECONDS = 1.0
#: a full collection of everything, frozen objects included, this often
FULL_COLLECTION_SECONDS = 600.0


def tune() -> threading.Thread:
    """Freeze the start-up heap, and from now on what survives a second; returns the freezing thread."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
    thread = threading.Thread(target=_freeze_forever, name="gc-freeze", daemon=True)
    thread.start()
    return thread


def _freeze_forever() -> None:
    collected = time.monotonic()
    while True:
        time.sleep(FREEZE_SECONDS)  # ok-sleep: the freezing period itself
        if time.monotonic() - collected >= FULL_COLLECTION_SECONDS:
            gc.unfreeze()
            gc.collect()
            collected = time.monotonic()
        gc.freeze()
