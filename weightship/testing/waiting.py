"""Waiting in tests and benchmarks without sleeping a fixed time: free ports and deadlines.

``eventually`` polls a probe until it returns something truthy and returns that, or fails at a
deadline naming what it waited for and the last thing the probe said. Probes that raise a
"not yet" error (a refused connection, an answer not parseable yet, a key not there yet) are
polled again; any other exception propagates at once, because it is a bug, not a wait.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

import httpx

__all__ = ["NOT_YET", "eventually", "eventually_async", "free_port", "wait_for_port"]

_T = TypeVar("_T")

#: Exceptions a probe may raise while the thing it waits for is not there yet.
NOT_YET: tuple[type[BaseException], ...] = (OSError, ValueError, LookupError, httpx.HTTPError)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout}s waiting for {what}; last probe: {last!r}")


def eventually(
    probe: Callable[[], _T | None],
    timeout: float,
    what: str = "the condition",
    *,
    interval: float = 0.05,
    not_yet: tuple[type[BaseException], ...] = NOT_YET,
) -> _T:
    """``probe()``'s first truthy result, polling every ``interval`` s until ``timeout`` s pass.

    Raises ``AssertionError`` naming ``what`` and the last result (or ``not_yet`` error) at the
    deadline.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = probe()
            if result:
                return result
            last = result
        except not_yet as exc:
            last = exc
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)  # ok-sleep: polling interval of a deadline loop


@overload
async def eventually_async(
    probe: Callable[[], Awaitable[_T | None]],
    timeout: float,  # noqa: ASYNC109 - a polling deadline, not a cancellation scope
    what: str = ...,
    *,
    interval: float = ...,
    not_yet: tuple[type[BaseException], ...] = ...,
) -> _T: ...


@overload
async def eventually_async(
    probe: Callable[[], _T | None],
    timeout: float,  # noqa: ASYNC109 - a polling deadline, not a cancellation scope
    what: str = ...,
    *,
    interval: float = ...,
    not_yet: tuple[type[BaseException], ...] = ...,
) -> _T: ...


async def eventually_async(
    probe: Callable[[], Awaitable[_T | None] | _T | None],
    timeout: float,  # noqa: ASYNC109 - a polling deadline, not a cancellation scope
    what: str = "the condition",
    *,
    interval: float = 0.05,
    not_yet: tuple[type[BaseException], ...] = NOT_YET,
) -> _T:
    """``eventually`` for a sync or async ``probe``, waiting on the event loop between polls."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = probe()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            last = result
        except not_yet as exc:
            last = exc
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        await asyncio.sleep(interval)  # ok-sleep: polling interval of a deadline loop


def wait_for_port(
    port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None, host: str = "127.0.0.1"
) -> None:
    """Return once something accepts connections on ``host:port``; fail early if ``proc`` exits."""

    def accepting() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.create_connection((host, port), timeout=0.5):
            return True

    eventually(accepting, timeout, f"something to listen on {host}:{port}")
