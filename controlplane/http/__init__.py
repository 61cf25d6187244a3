"""The control plane's HTTP layer: routers, FastAPI dependencies, request limits and request/response mapping.

Routers here parse requests, check who is calling (``controlplane.http.auth``) and shape responses;
what a request *means* is decided in the domain modules below (``controlplane.registry``,
``publish``, ``deployments``, ``fleet``, ``tokens``), which know nothing of HTTP.
"""
