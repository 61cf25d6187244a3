"""The control plane's one error boundary: every error leaves as RFC 9457 problem details.

An error answer is ``application/problem+json``::

    {"type": "https://weightship.dev/problems/model_not_found", "title": "Not Found", "status": 404,
     "detail": "model 'chat' does not exist; ...", "instance": "/v1/models/chat/versions",
     "code": "model_not_found", "model": "chat"}

``code`` is our stable extension: clients branch on it, never on ``detail`` (prose for people of
the REST API, which may name routes and JSON fields). A domain error's ``fields`` (what it is
about: ``model``, ``deployment``, ``epoch``...) become further members, so that another interface
(the CLI) can say the same thing in its own words. A ``TemporaryError`` also carries
``retry_after`` and the ``Retry-After`` header; a 401 carries ``WWW-Authenticate``.

``install`` maps everything that can escape a request into this shape: our ``WeightshipError``,
the database's connection failures (503 ``database_unavailable``), FastAPI's request validation
(422 ``invalid_request``), Starlette's own 400/404/405 (``bad_request``, ``no_route``,
``method_not_allowed``) and anything unexpected (500 ``internal``, logged with its traceback).
The body limit (``controlplane.http.limits``) answers 413 with ``problem_bytes``.

``document`` lists in the OpenAPI document every status each route can return: the ones its
decorator declares with ``errors(...)`` and the ones every route shares (401/403 where a token is
required, 413, 422, 500, 503), each with the problem schema.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from sqlalchemy import exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.persistence.engine import database_errors
from weightship.errors import Field, WeightshipError
from weightship.logs import event
from weightship.problems import PROBLEM_MEDIA_TYPE, error_problem, problem_document, status_title

__all__ = ["PROBLEM_MEDIA_TYPE", "Problem", "document", "error_response", "errors", "install", "problem_bytes", "problem_response"]

log = logging.getLogger(__name__)

#: codes of the errors the framework itself raises, by status
_FRAMEWORK_CODES = {400: "bad_request", 404: "no_route", 405: "method_not_allowed"}
#: statuses every route under /v1 can answer, whatever it does
_SHARED = (413, 500, 503)
_AUTHENTICATED = (401, 403)


class Problem(BaseModel):
    """RFC 9457 problem details with our stable ``code``; domain errors add the fields they are about."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    instance: str
    code: str
    retry_after: int | None = None


def problem_response(
    status: int,
    code: str,
    detail: str,
    instance: str,
    *,
    fields: Mapping[str, Field | int] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A problem-details answer."""
    body = problem_document(status, code, detail, instance, fields)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}), media_type=PROBLEM_MEDIA_TYPE)


def problem_bytes(status: int, code: str, detail: str, instance: str) -> bytes:
    """The body of a problem-details answer, for ASGI code that sends its own messages."""
    return json.dumps(problem_document(status, code, detail, instance), separators=(",", ":")).encode()


def error_response(err: WeightshipError, path: str) -> JSONResponse:
    """The problem-details answer of ``err`` escaping a request to ``path``."""
    body, headers = error_problem(err, path)
    return JSONResponse(body, status_code=err.status_code, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def install(app: FastAPI) -> None:
    """Answer every error escaping ``app``'s routes with problem details, and document their schema."""
    _serve_problem_schema(app)

    @app.exception_handler(WeightshipError)
    async def _weightship_error(request: Request, err: WeightshipError) -> JSONResponse:
        return error_response(err, request.url.path)

    async def _database_error(request: Request, err: Exception) -> JSONResponse:
        # A route that does not map database failures itself: the same 503 the mapped ones give.
        try:
            with database_errors(f"{request.method} {request.url.path}"):
                raise err
        except WeightshipError as mapped:
            event(log, "database.unavailable", logging.WARNING, path=request.url.path, error=type(err).__name__)
            return error_response(mapped, request.url.path)

    for failure in (exc.OperationalError, exc.InterfaceError, exc.TimeoutError):
        app.add_exception_handler(failure, _database_error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return problem_response(
            422, "invalid_request", f"{where}: {first.get('msg', 'invalid request')}", request.url.path
        )

    @app.exception_handler(StarletteHTTPException)
    async def _framework_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        status = err.status_code
        code = _FRAMEWORK_CODES.get(status, f"http_{status}")
        where = f"{request.method} {request.url.path}"
        if status == 404:
            detail = f"no route {where}: this control plane's routes are listed at /docs and /openapi.json"
        elif status == 405:
            allowed = (err.headers or {}).get("Allow", "")
            detail = f"{request.url.path} does not accept {request.method}" + (
                f"; it accepts {allowed}" if allowed else ""
            )
        else:
            detail = f"{where}: {err.detail}"
        return problem_response(status, code, detail, request.url.path, headers=err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        event(
            log,
            "request.failed",
            logging.ERROR,
            method=request.method,
            path=request.url.path,
            error=type(err).__name__,
            exc_info=True,
        )
        detail = (
            f"the control plane failed on {request.method} {request.url.path} ({type(err).__name__}); "
            "this is a bug: check the control plane's log, then retry"
        )
        return problem_response(500, "internal", detail, request.url.path)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route decorator: the error statuses this route answers besides the shared ones."""
    return {status: _documented(status) for status in statuses}


def _documented(status: int) -> dict[str, Any]:
    return {
        "description": status_title(status),
        "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


def _requires_token(route: APIRoute) -> bool:
    pending = list(route.dependant.dependencies)
    while pending:
        dependency = pending.pop()
        if getattr(dependency.call, "__module__", "") == "controlplane.http.auth":
            return True
        pending.extend(dependency.dependencies)
    return False


def _validates_input(route: APIRoute) -> bool:
    """Whether FastAPI can refuse a request to ``route`` with 422: a body, a query, or a typed path or header value.

    A plain string in the path or a header accepts anything, so a route with only those never answers 422.
    """
    d = route.dependant
    typed = [p for p in (*d.path_params, *d.header_params) if p.field_info.annotation not in (str, str | None)]
    return bool(d.body_params or d.query_params or typed)


def document(router: APIRouter) -> None:
    """Add to each route of ``router`` (and of routers it includes) the error statuses every route shares.

    Call it before the router is included in the app: FastAPI builds the routes it serves from these.
    """
    for route in router.routes:
        included = getattr(route, "original_router", None)  # a router included in this one
        if isinstance(included, APIRouter):
            document(included)
        if not isinstance(route, APIRoute):
            continue
        shared = list(_SHARED)
        if _requires_token(route):
            shared += _AUTHENTICATED
        if _validates_input(route):
            shared.append(422)
        for status in shared:
            # a route's own 422 (FastAPI's default schema otherwise) is a problem too
            route.responses.setdefault(status, _documented(status))


def _serve_problem_schema(app: FastAPI) -> None:
    """Put the ``Problem`` schema into ``app``'s OpenAPI document, in place of FastAPI's validation error."""
    schema_of_app = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = schema_of_app()
            schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = Problem.model_json_schema()
            for unused in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(unused, None)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    # FastAPI adds a 422 to every route with parameters; only those ``document`` kept can answer it.
                    content = operation.get("responses", {}).get("422", {}).get("content", {})
                    if PROBLEM_MEDIA_TYPE not in content:
                        operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
