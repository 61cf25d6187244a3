"""Reading an error answer in a test: RFC 9457 problem details, checked for what every one carries."""

from __future__ import annotations

from typing import Any

import httpx

from weightship.problems import PROBLEM_MEDIA_TYPE

__all__ = ["problem"]


def problem(response: httpx.Response) -> dict[str, Any]:
    """The RFC 9457 problem details of an error ``response``, checked for the members every one carries."""
    assert response.headers["content-type"].startswith(PROBLEM_MEDIA_TYPE), response.headers
    body = response.json()
    assert isinstance(body, dict), body
    for member in ("type", "title", "status", "detail", "instance", "code"):
        assert member in body, (member, body)
    assert body["status"] == response.status_code, body
    assert body["type"].endswith("/" + body["code"]), body
    return body
