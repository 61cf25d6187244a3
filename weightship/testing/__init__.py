"""Helpers that weightship's tests and benchmarks share, public for anyone testing against weightship.

- ``free_port``, ``wait_for_port``: loopback ports for servers started as processes;
- ``eventually`` / ``eventually_async``: poll a probe until it holds, with a deadline and a
  failure that names what was awaited (never a fixed sleep);
- ``Origin``: a blob origin with HTTP range requests, recording what it served;
- ``FaultProxy``: a proxy in front of the control plane's blob route that corrupts, delays or
  holds the answers a test selects (a misbehaving network, CDN or cache);
- ``kill9`` / ``terminate``: end a process a test started, as a crash or cleanly.
- ``problem``: the RFC 9457 problem details of an error answer, checked for every member.
- ``serve_in_thread``: an ASGI app under a real uvicorn server in a thread (real HTTP, in-process);
- ``ManualClock`` / ``ManualUTCClock``: clocks a test moves by hand (timeouts without waiting).

Nothing here imitates weightship's own components: tests run the real control plane and agent.
"""

from __future__ import annotations

from weightship.testing.clocks import ManualClock, ManualUTCClock
from weightship.testing.origins import TEST_CHUNK, FaultProxy, Origin, Served
from weightship.testing.problems import problem
from weightship.testing.processes import kill9, terminate
from weightship.testing.servers import serve_in_thread
from weightship.testing.waiting import NOT_YET, eventually, eventually_async, free_port, wait_for_port

__all__ = [
    "NOT_YET",
    "TEST_CHUNK",
    "FaultProxy",
    "ManualClock",
    "ManualUTCClock",
    "Origin",
    "Served",
    "eventually",
    "eventually_async",
    "free_port",
    "kill9",
    "problem",
    "serve_in_thread",
    "terminate",
    "wait_for_port",
]
