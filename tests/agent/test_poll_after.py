"""The agent reads the control plane's ``Poll-After`` (when to long-poll again), bounded, and ignores a bad one."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agent.controlplane_client import ControlPlaneClient

pytestmark = pytest.mark.timeout(30)

STATE = {"node_id": "n1", "revision": "r2", "deployments": []}


@pytest.mark.parametrize(
    ("header", "delay"),
    [(None, 0.0), ("2.5", 2.5), ("0", 0.0), ("9999", 60.0), ("-3", 0.0), ("soon", 0.0), ("nan", 0.0)],
)
def test_the_agent_waits_as_long_as_poll_after_says_within_bounds(header: str | None, delay: float) -> None:
    headers = {} if header is None else {"Poll-After": header}

    async def ask() -> float:
        answer = httpx.Response(200, json=STATE, headers=headers)
        client = ControlPlaneClient("http://cp.test", "t", transport=httpx.MockTransport(lambda r: answer))
        try:
            state, poll_after = await client.desired("n1", "r1", 30)
        finally:
            await client.aclose()
        assert state.revision == "r2"
        return poll_after

    assert asyncio.run(ask()) == delay
