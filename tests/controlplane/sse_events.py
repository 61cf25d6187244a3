"""Reading a server-sent-events answer (the status page's live feed) as (event, data) pairs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx


def events(response: httpx.Response) -> Iterator[tuple[str, str]]:
    """(event, data) of a server-sent-events response, as they arrive."""
    name, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and data:
            yield name, data
            name, data = "message", ""
