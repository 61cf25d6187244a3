"""``weightship.testing``: the public helpers tests and benchmarks share."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import weightship.testing
from weightship.testing import Origin, eventually, eventually_async, free_port, wait_for_port

pytestmark = pytest.mark.timeout(30)


def test_public_surface_is_exactly_all() -> None:
    names = {"NOT_YET", "TEST_CHUNK", "FaultProxy", "ManualClock", "ManualUTCClock", "Origin", "Served"}
    names |= {"eventually", "eventually_async", "free_port", "kill9", "problem", "serve_in_thread", "terminate", "wait_for_port"}
    assert set(weightship.testing.__all__) == names
    for name in names:
        assert getattr(weightship.testing, name).__doc__ or name in {"NOT_YET", "TEST_CHUNK"}


def test_eventually_returns_the_first_truthy_probe_result() -> None:
    answers = iter([None, 0, "", "ready"])
    assert eventually(lambda: next(answers), timeout=5, what="readiness", interval=0.001) == "ready"


def test_eventually_fails_at_the_deadline_naming_what_and_the_last_probe() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"waiting for the answer; last probe: ConnectionRefusedError"):
        eventually(lambda: socket.create_connection(("127.0.0.1", free_port()), timeout=0.1), 0.2, "the answer")
    assert time.monotonic() - started < 5


def test_a_probe_that_raises_a_bug_is_not_retried() -> None:
    calls: list[int] = []

    def probe() -> bool:
        calls.append(1)
        raise TypeError("a bug in the test")

    with pytest.raises(TypeError, match="a bug"):
        eventually(probe, timeout=5)
    assert calls == [1]


def test_eventually_async_awaits_async_probes() -> None:
    answers = iter([None, None, 42])

    async def probe() -> int | None:
        return next(answers)

    assert asyncio.run(eventually_async(probe, 5, "the value", interval=0.001)) == 42


def test_free_ports_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_wait_for_port_fails_at_once_when_the_process_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_for_port(free_port(), timeout=20, proc=proc)
    assert time.monotonic() - started < 5


def test_the_origin_serves_byte_ranges_and_records_them(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 8

    async def run() -> bytes:
        origin = Origin(tmp_path)
        (origin.blobs / "ab").write_bytes(blob)
        await origin.start()
        try:
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"{origin.url}/blobs/ab", headers={"Range": "bytes=10-19"})
            assert answer.status_code == 206
            assert [(s.blob, s.start, s.end, s.complete) for s in origin.served] == [("ab", 10, 20, True)]
            return answer.content
        finally:
            await origin.stop()

    assert asyncio.run(run()) == blob[10:20]
