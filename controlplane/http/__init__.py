"""The control plane's HTTP layer: routers, FastAPI dependencies, request limits and request/response mapping.

Routers here parse requests, check who is calling (``controlplane.http.auth``) and shape responses;
what a request *means* is decided in the domain modules below (``controlplane.registry``,
``publish``, ``deployments``, ``fleet``, ``tokens``), which know nothing of HTTP.
"""

from __future__ import annotations

from starlette.requests import Request

from controlplane.state import AppState

__all__ = ["state_of"]


def state_of(request: Request) -> AppState:
    """The ``AppState`` of the application serving ``request``."""
    state = request.app.state.ws
    assert isinstance(state, AppState), "the application's lifespan sets app.state.ws before any request"
    return state
