"""Numbers from outside the agent parsed as ASCII digits only: ``str.isdigit`` also takes "²", which ``int`` refuses.

Threat: a hostile peer or cache answers with a status or ``Content-Length`` of "²" (or a model
server's pidfile holds it); a check with ``str.isdigit`` lets it through, and ``int`` then raises
``ValueError``, an error no caller expects (a 500 at the peer listener, a fetch that dies on an
exception group at the node). Each is refused as our own error instead. The peer listener's own
``index=²`` case runs against a real agent in ``test_peer_listener_bounds.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.hookcalls import SwitchHook, send_signal
from agent.rangeclient import RangeClient
from weightship.errors import WeightshipError

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def _answering(head: bytes) -> AsyncIterator[str]:
    """A server answering every request with ``head`` (and nothing more); yields its URL."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chunks/x"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 \xc2\xb200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\n",
     b"HTTP/1.1 503 Busy\r\nContent-Length: \xc2\xb2\r\n\r\n"],
    ids=["status", "content_length", "error_body_length"],
)
async def test_a_peer_answering_a_superscript_number_is_refused_as_our_error(head: bytes) -> None:
    client = RangeClient(read_timeout=5)
    try:
        async with _answering(head) as url:
            with pytest.raises(WeightshipError):
                await client.get(url, memoryview(bytearray(16)), lambda _n: None)
    finally:
        await client.close()


def test_a_pidfile_holding_a_superscript_number_is_refused_not_raised(tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    pidfile.write_text("²")
    answer = send_signal(SwitchHook("chat", "signal", pidfile=str(pidfile)))
    assert answer["ok"] is False
    assert "not a process id" in answer["detail"]
