"""CPU accounting the benchmarks share: this process's and its children's CPU, and the whole host's.

On a shared machine a wall-clock ratio is only as good as the cores the run had; benchmarks print
what other processes kept busy (``host_busy`` over an interval, less their own CPU) beside it.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

__all__ = ["cpu_seconds", "host_busy"]


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """User + system CPU seconds of ``who`` so far (``resource.RUSAGE_SELF`` or ``RUSAGE_CHILDREN``:
    every child process waited for)."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def host_busy() -> float:
    """CPU-seconds every process on the host has run so far (``/proc/stat``; 0 where there is none)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
