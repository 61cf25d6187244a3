"""Durability off the readiness path: a version is ready once verified, and made durable just after.

A version becomes ready when every chunk was verified and written (into the page cache), its
verification record written and its directory renamed into ``versions/``. Flushing its bytes to
the disk (``fsync`` of every file and directory) is not on that path: on a busy disk it took
longer than the download itself, and a killed process loses nothing that is in the page cache.
Only a power loss or a kernel crash does, and this is what guards against it:

1. When a staging area is opened, before its first chunk is written, it gets the marker
   ``.weightship/unsynced``, made durable at once (an empty file; nothing else is dirty yet).
2. The marker travels with the directory into ``versions/``. ``Flusher`` then, in the background
   (after ``delay`` seconds), fsyncs every file, the verification record and every directory, and
   only then removes the marker and fsyncs its directory (``make_durable``).
3. At start-up ``VersionStore.recover`` hashes every chunk of each ready version that still has
   the marker (``settle``): a crash between ready and durable may have lost any of its bytes.
   If all match, the version is made durable and stays ready. Otherwise the directory goes back
   to ``staging/`` with a journal naming only the chunks that matched, and the next fetch of the
   version (which hashes journaled chunks once more) fetches the rest.

So after any crash the agent trusts only bytes it hashed: either durable before the crash, or
hashed again after it. Versions without the marker (made durable inline, as all were before this
module) are trusted as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.durable import atomic_write, fsync_dir
from agent.verifier import bad_chunks
from weightship.layout import META_DIR, VERIFIED_FILE
from weightship.logs import event
from weightship.manifest import Manifest

__all__ = ["UNSYNCED_FILE", "Flusher", "is_unsynced", "make_durable", "mark_unsynced", "settle"]

log = logging.getLogger("agent.durability")

#: the marker of a directory whose bytes may not all be on the disk yet (under ``.weightship/``)
UNSYNCED_FILE = "unsynced"


def is_unsynced(directory: Path) -> bool:
    """Whether ``directory`` carries the unsynced marker."""
    return (directory / META_DIR / UNSYNCED_FILE).exists()


def mark_unsynced(directory: Path) -> None:
    """Give ``directory`` the unsynced marker, durably (call before its first chunk is written)."""
    marker = directory / META_DIR / UNSYNCED_FILE
    if not marker.exists():
        atomic_write(marker, b"")


def make_durable(directory: Path) -> None:
    """fsync every file and directory under ``directory``, then remove its unsynced marker durably."""
    marker = directory / META_DIR / UNSYNCED_FILE
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name == UNSYNCED_FILE and Path(dirpath) == marker.parent:
                continue
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
    fsync_dir(directory.parent)  # the rename into versions/
    marker.unlink(missing_ok=True)
    fsync_dir(marker.parent)


def settle(directory: Path, manifest: Manifest, staging_dir: Path) -> bool:
    """After a restart: hash every chunk of unsynced ready version ``directory``; True if it stays ready.

    All chunks match: the version is made durable. Some do not: it moves to ``staging_dir`` with a
    journal of the chunks that matched (``agent.staging``'s format), so only the rest is fetched.
    """
    bad = bad_chunks(directory, manifest)
    if not bad:
        make_durable(directory)
        event(log, "store.version_resynced", digest=manifest.digest, path=str(directory))
        return True
    lines = []
    for index, entry in enumerate(manifest.files):
        broken = bad.get(index, set())
        if os.lstat(directory / entry.path).st_nlink > 1:
            if not broken:  # a file linked from another version: resumed as linked, hashed again then
                lines.append(f"f {index}\n")
            continue
        lines += [f"c {index} {c}\n" for c in range(len(entry.chunks)) if c not in broken]
    target = staging_dir / directory.name
    journal = staging_dir / f"{directory.name}.journal"
    if target.exists():
        raise FileExistsError(f"{target} exists; cannot move the unsynced version {manifest.digest} back")
    (directory / META_DIR / VERIFIED_FILE).unlink(missing_ok=True)
    atomic_write(journal, "".join(lines).encode("ascii"))
    os.rename(directory, target)
    fsync_dir(directory.parent)
    fsync_dir(staging_dir)
    event(
        log,
        "store.version_damaged",
        logging.WARNING,
        digest=manifest.digest,
        bad_chunks=sum(len(v) for v in bad.values()),
        files=[manifest.files[i].path for i in sorted(bad)],
        action="moved back to staging; the bad chunks are fetched again",
    )
    return False


class Flusher:
    """Makes ready versions durable in the background, one at a time, on a thread of its own."""

    def __init__(self, delay: float = 0.0) -> None:
        #: seconds between a version becoming ready and its flush (the kernel writes back meanwhile)
        self.delay = delay
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ws-flush")
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, directory: Path, digest: str) -> None:
        """Flush ready version ``directory`` soon (call on the event loop)."""
        task = asyncio.get_running_loop().create_task(self._flush(directory, digest))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self, directory: Path, digest: str) -> None:
        if self.delay > 0:
            await asyncio.sleep(self.delay)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await loop.run_in_executor(self._executor, make_durable, directory)
        except FileNotFoundError:
            return  # evicted before its flush: nothing left to make durable
        except OSError as exc:
            # The marker stays: a restart hashes the version again before trusting it.
            event(log, "store.flush_failed", logging.WARNING, digest=digest, error=str(exc))
            return
        event(log, "store.durable", digest=digest, seconds=f"{loop.time() - started:.3f}")

    def close(self) -> None:
        """Cancel flushes not yet started; a started one finishes on its thread."""
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(RuntimeError):
            self._executor.shutdown(wait=False, cancel_futures=True)
