"""Peer listener: ``loop.sendfile`` against read-then-write, for 64 MiB chunks over loopback, in one run.

The real ``PeerServer`` (ticket check included) serves one 64 MiB chunk from a file on tmpfs to
16 concurrent ``curl`` processes; ``plain`` is the same server with its send step replaced by
``os.pread`` into memory and ``StreamResponse.write`` (what serving without sendfile costs).
Prints GB/s delivered and the server process's CPU seconds, one JSON line per kind.

Usage: python bench/peer_sendfile.py [--rounds 2]   (needs curl; kinds alternate each round)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from aiohttp import web

from agent.peerserver import ChunkLocation, PeerServer
from agent.tickets import TicketKeeper
from weightship.tickets import Ticket, key_id, new_private_key, public_key_text, sign_ticket

SIZE = 64 * 1024 * 1024
CLIENTS = 16
VERSION = "sha256:" + "a" * 64


class OneFile:
    """Every chunk is the whole of one file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def locate(self, chunk: str, version: str, blob: str, index: int) -> ChunkLocation:
        return ChunkLocation(self.path, 0, SIZE)


class ReadThenWrite(PeerServer):
    """The peer server without sendfile: bytes through user space."""

    async def _send(self, request: web.Request, fobj: BinaryIO, where: ChunkLocation, chunk: str) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = where.length
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(None, os.pread, fobj.fileno(), where.length, where.offset)
        await response.write(data)
        await response.write_eof()
        return response


async def measure(kind: str, path: Path) -> dict[str, object]:
    key = new_private_key()
    kid = key_id(key.public_key())
    tickets = TicketKeeper(None)  # type: ignore[arg-type]  # checks only: keys learnt below
    tickets.learn_keys({kid: public_key_text(key.public_key())})
    now = int(time.time())
    token = sign_ticket(key, Ticket(kid=kid, node="bench", versions=frozenset({VERSION}), iat=now, exp=now + 600))
    server = (PeerServer if kind == "sendfile" else ReadThenWrite)(OneFile(path), tickets, upload_concurrency=64)
    url = await server.start("127.0.0.1:0")
    target = f"{url}/v1/chunks/{'b' * 64}?version={VERSION}&blob={'c' * 64}&index=0"
    argv = ["curl", "-s", "-o", "/dev/null", "-H", f"Authorization: Ticket {token}", "-w", "%{size_download}\n"]
    began, cpu0 = time.perf_counter(), os.times()
    procs = [await asyncio.create_subprocess_exec(*argv, target, stdout=subprocess.PIPE) for _ in range(CLIENTS)]
    outs = [await p.communicate() for p in procs]
    elapsed, cpu1 = time.perf_counter() - began, os.times()
    await server.stop()
    assert all(int(out) == SIZE for out, _err in outs), outs
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "kind": kind,
        "chunks": CLIENTS,
        "gb_per_s": round(CLIENTS * SIZE / elapsed / 1e9, 2),
        "server_cpu_s": round(cpu, 2),
    }


async def rounds(path: Path, count: int) -> None:
    for _ in range(count):
        for kind in ("sendfile", "plain"):
            print(json.dumps(await measure(kind, path)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        path = Path(tmp) / "chunk"
        path.write_bytes(os.urandom(SIZE))
        asyncio.run(rounds(path, args.rounds))


if __name__ == "__main__":
    main()
