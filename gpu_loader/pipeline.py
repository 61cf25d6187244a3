"""Running a load plan: reader threads, the hash pool, and tensors handed out as they complete.

::

    items (plan order) ──▶ R reader threads ── os.preadv ──▶ block memory (arena or pinned staging)
                                 │                               │
                                 │ CUDA: copy_ on own stream ◀───┤
                                 ▼                               ▼
                         item done (trust)         ChunkCheck on the hash pool (full / fast)
                                 │                               │ verdict
                                 └──────────────┬────────────────┘
                                                ▼
                     tracker: a tensor is ready when every item touching it is done
                                                ▼
                            consumer thread receives slot indices, in completion order

The first failure (a read error, a digest mismatch) cancels the load: readers stop between
blocks, nothing more is handed out, and the consumer gets the error. Whatever happens, the
pipeline waits for its threads and the device's copy streams before it returns, so no buffer it
used is still being written or read.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from gpu_loader.checksums import ChecksumRecord
from gpu_loader.errors import ChunkMismatchError
from gpu_loader.plan import Item, LoadPlan
from gpu_loader.targets import Target
from gpu_loader.verifying import ChunkCheck, Expectation, Verdict
from gpu_loader.version import OpenFile

__all__ = ["CheckPolicy", "Pipeline", "PipelineCounters"]

_log = logging.getLogger(__name__)
_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)


@dataclass
class CheckPolicy:
    """How chunks are checked: ``full`` (SHA-256), ``fast`` (CRC32 record, else SHA-256), ``trust``."""

    mode: str
    record: ChecksumRecord | None = None

    def expectation(self, item: Item, opened: OpenFile) -> Expectation | None:
        """What ``item``'s chunk must hash to; ``None`` when it is not checked."""
        if self.mode == "trust" or item.chunk is None:
            return None
        sha = opened.entry.chunks[item.chunk]
        if self.mode == "fast" and self.record is not None:
            crc = self.record.expected(opened.entry.path, opened.identity, item.chunk)
            if crc is not None:
                return Expectation(sha256=None, crc32=crc)
            return Expectation(sha256=sha, crc32=None, want_crc=True)
        return Expectation(sha256=sha, crc32=None)


@dataclass
class PipelineCounters:
    """What a load did."""

    bytes_read: int = 0
    chunks_sha256: int = 0
    chunks_crc32: int = 0


@dataclass
class _Tracker:
    pending: list[int]
    events: list[list[torch.cuda.Event]]
    ready: queue.SimpleQueue[int | None] = field(default_factory=queue.SimpleQueue)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    """One run of a plan; iterate ``ready()`` for slot indices, then read ``counters``."""

    def __init__(
        self,
        plan: LoadPlan,
        files: Sequence[OpenFile],
        target: Target,
        policy: CheckPolicy,
        *,
        readers: int,
        hash_workers: int,
    ) -> None:
        self.plan = plan
        self.files = files
        self.target = target
        self.policy = policy
        self.readers = max(1, min(readers, len(plan.items) or 1))
        self.hash_workers = max(1, hash_workers)
        self.counters = PipelineCounters()
        pending = [0] * len(plan.slots)
        for item in plan.items:
            for slot in item.slots:
                pending[slot] += 1
        self._tracker = _Tracker(pending=pending, events=[[] for _ in plan.slots])
        self._next = 0
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._error: BaseException | None = None
        self._checking = 0

    def events(self, slot: int) -> list[torch.cuda.Event]:
        """CUDA events the consumer's stream must wait on before using ``slot``'s tensor."""
        return self._tracker.events[slot]

    def ready(self) -> Generator[int, None, None]:
        """Slot indices as their tensors become complete and verified; raises the first failure."""
        tracker = self._tracker
        remaining = len(self.plan.slots)
        for index, count in enumerate(tracker.pending):
            if count == 0:
                remaining -= 1
                yield index
        pool = ThreadPoolExecutor(self.hash_workers, thread_name_prefix="ws-load-hash")
        threads = [
            threading.Thread(target=self._read, args=(i, pool), name=f"ws-load-read-{i}", daemon=True)
            for i in range(self.readers if self.plan.items else 0)
        ]
        for thread in threads:
            thread.start()
        try:
            while remaining:
                try:
                    slot = tracker.ready.get(timeout=1.0)
                except queue.Empty:
                    if self._stalled(threads):
                        self._fail(
                            RuntimeError("gpu_loader internal error: readers finished but tensors are incomplete")
                        )
                    continue
                if slot is None:
                    break
                remaining -= 1
                yield slot
            if self._error is not None:
                raise self._error
        finally:
            self._cancelled.set()
            for thread in threads:
                thread.join()
            pool.shutdown(wait=True)  # queued hashing finishes, so every staging buffer goes back
            self.target.finish()
        if self._error is not None:
            raise self._error

    def _stalled(self, threads: list[threading.Thread]) -> bool:
        with self._lock:
            checking = self._checking
        return checking == 0 and not any(t.is_alive() for t in threads)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._cancelled.set()
        self._tracker.ready.put(None)

    def _take(self) -> Item | None:
        with self._lock:
            if self._next >= len(self.plan.items) or self._cancelled.is_set():
                return None
            item = self.plan.items[self._next]
            self._next += 1
            ahead = self._next - 1 + self.readers
            upcoming = self.plan.items[ahead] if ahead < len(self.plan.items) else None
        if upcoming is not None and _WILLNEED is not None:
            # Start the disk on the item after this round while this one is read: cold loads keep
            # the device queue busy instead of waiting on readahead one window at a time.
            os.posix_fadvise(self.files[upcoming.file].fd, upcoming.start, upcoming.end - upcoming.start, _WILLNEED)
        return item

    def _read(self, reader: int, pool: ThreadPoolExecutor) -> None:
        try:
            self.target.start_reader()
            while (item := self._take()) is not None:
                self._read_item(reader, item, pool)
        except BaseException as exc:
            self._fail(exc)

    def _read_item(self, reader: int, item: Item, pool: ThreadPoolExecutor) -> None:
        opened = self.files[item.file]
        expect = self.policy.expectation(item, opened)
        event_box: list[torch.cuda.Event | None] = [None]
        check = None
        if expect is not None:
            with self._lock:
                self._checking += 1
            check = ChunkCheck(pool, expect, self._on_verdict(item, opened, expect, event_box))
        for block in item.blocks:
            if self._cancelled.is_set():
                return
            buf = self.target.buffer(item.file, block, self._cancelled)
            if buf is None:
                return
            try:
                self.target.fill(item.file, opened, block, buf)
                event_box[0] = self.target.after_read(reader, item.file, block, buf) or event_box[0]
            except BaseException:
                buf.release()
                raise
            if check is not None:
                check.feed(buf.views, buf.release)
            else:
                buf.release()
        with self._lock:
            self.counters.bytes_read += item.end - item.start
        if check is not None:
            check.close()
        else:
            self._item_done(item, event_box[0])

    def _on_verdict(
        self, item: Item, opened: OpenFile, expect: Expectation, event_box: list[torch.cuda.Event | None]
    ) -> Callable[[Verdict], None]:
        def done(verdict: Verdict) -> None:
            try:
                if verdict.error is not None:
                    self._fail(verdict.error)
                elif not verdict.ok:
                    self._fail(self._mismatch(item, opened, expect, verdict))
                else:
                    with self._lock:
                        if expect.sha256 is not None:
                            self.counters.chunks_sha256 += 1
                        else:
                            self.counters.chunks_crc32 += 1
                        if expect.want_crc and verdict.crc32 is not None and self.policy.record is not None:
                            assert item.chunk is not None
                            self.policy.record.add(opened.entry.path, opened.identity, item.chunk, verdict.crc32)
                    self._item_done(item, event_box[0])
            except BaseException as exc:
                self._fail(exc)
            finally:
                with self._lock:  # only now: the stall check must not see a verdict half-delivered
                    self._checking -= 1

        return done

    def _mismatch(self, item: Item, opened: OpenFile, expect: Expectation, verdict: Verdict) -> ChunkMismatchError:
        names = [self.plan.slots[s].name for s in item.slots]
        shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        if expect.sha256 is not None:
            what = f"SHA-256 {verdict.sha256} but the manifest says {expect.sha256}"
        else:
            what = f"CRC32 {verdict.crc32:#010x} but this host recorded {expect.crc32:#010x} when it last verified it"
        return ChunkMismatchError(
            f"chunk {item.chunk} (bytes {item.start}-{item.end}) of {opened.entry.path!r} hashes to {what}; "
            f"it holds tensor(s) {shown or '(header only)'}. Nothing was returned: the version on disk is corrupt, "
            "re-fetch it"
        )

    def _item_done(self, item: Item, event: torch.cuda.Event | None) -> None:
        tracker = self._tracker
        with tracker.lock:
            for slot in item.slots:
                if event is not None:
                    tracker.events[slot].append(event)
                tracker.pending[slot] -= 1
                if tracker.pending[slot] == 0:
                    tracker.ready.put(slot)
