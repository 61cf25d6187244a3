"""Durable file-system steps: atomic replacement, fsync of files and directories.

A crash (kill -9, power loss) must leave either the old or the new state on disk, never a mix:
new content is written to a temporary name in the same directory, fsynced, renamed over the old
name, and the directory is fsynced so the rename itself survives. ``ENOSPC``/``EDQUOT`` become
``DiskFullError`` here, at the boundary, so callers catch ours and not ``OSError``.

``start_writeback`` asks the kernel to start writing a range of a file now, without waiting: a
version written chunk by chunk then drains to disk while the rest downloads, and the fsync that
makes it durable finds little left to flush (``bench/fetch.py``: the fsync of 1 GiB fell from
about 0.3 s to a few tens of ms). It is Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
reached through ``ctypes`` because the ``os`` module does not wrap it; elsewhere it does nothing.
It never replaces an fsync: it only starts early what the fsync would do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from weightship.errors import DiskFullError

__all__ = ["atomic_symlink", "atomic_write", "disk_full_as_ours", "fsync_dir", "is_disk_full", "start_writeback"]

#: ``SYNC_FILE_RANGE_WRITE`` (linux/fs.h): start writeback of dirty pages in the range, do not wait
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", function)


_SYNC_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` to disk without waiting; whether it could.

    Best effort: a file system or platform without it leaves the work to the later fsync.
    """
    if _SYNC_RANGE is None or length <= 0:
        return False
    return int(_SYNC_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)) == 0


def is_disk_full(exc: OSError) -> bool:
    """Whether ``exc`` says the disk (or the user's disk quota) is full."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def disk_full_as_ours(what: str) -> Iterator[None]:
    """Re-raise ``ENOSPC``/``EDQUOT`` inside the block as a ``DiskFullError`` naming ``what``."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(
                f"disk full while writing {what}: free space on the data disk or lower other usage, "
                "then the agent retries"
            ) from exc
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (renames, new names) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``) so that a crash leaves the old or the new content."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with disk_full_as_ours(str(path)):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(path.parent)


def atomic_symlink(link: Path, target: str) -> None:
    """Point ``link`` at ``target``: a new symlink renamed over the old one, never a missing link."""
    tmp = link.with_name(f".{link.name}.{secrets.token_hex(4)}.tmp")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)
