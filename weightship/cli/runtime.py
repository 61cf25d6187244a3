"""What every ``weightship`` command shares: its global options, its output, its errors and exit status.

A command is a typer function wrapped in :func:`command`: a ``WeightshipError`` it raises ends the
run with one red line on stderr (a JSON ``ErrorBody`` under ``--json``) and the exit status of its
kind (``EXIT_CODES``), never a traceback. :func:`out` prints JSON for scripts or the renderable a
command builds for people. The command groups (``weightship.cli``, ``weightship.cli.rollouts``) use
these and nothing else, so every command behaves alike.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, ParamSpec, TypeVar

import httpx
import typer
from pydantic import BaseModel
from rich.console import Console, RenderableType
from rich.text import Text

from weightship.cli import display
from weightship.cli.errors import cli_message
from weightship.client import Backoff, Client
from weightship.errors import (
    AuthError,
    ConflictError,
    ForbiddenError,
    PreconditionFailed,
    TemporaryError,
    WeightshipError,
)

__all__ = ["EXIT_CODES", "CliSeams", "Run", "command", "fail", "jsonable", "out", "run_of"]

#: Exit status by error kind; 2 is click's own usage error.
EXIT_CODES: dict[type[WeightshipError], int] = {
    PreconditionFailed: 3,
    ConflictError: 3,
    AuthError: 4,
    ForbiddenError: 4,
    TemporaryError: 5,
}

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass
class CliSeams:
    """What tests may inject into a CLI run: the HTTP transport, the sleep of backoffs and polls, the clock."""

    transport: httpx.BaseTransport | None = None
    sleep: Callable[[float], None] = time.sleep
    #: monotonic seconds; what ``--watch --timeout`` and ``--wait`` measure against
    clock: Callable[[], float] = time.monotonic


@dataclass
class Run:
    """The global options of one invocation."""

    url: str
    token: str | None
    json: bool
    seams: CliSeams

    def client(self) -> Client:
        """A control-plane client for this run; a person waits, so an unreachable server fails in ~1 s."""
        backoff = Backoff(attempts=3, base=0.2, cap=1.0, sleep=self.seams.sleep)
        return Client(self.url, self.token, transport=self.seams.transport, backoff=backoff)


def run_of(ctx: typer.Context) -> Run:
    """The global options of the invocation ``ctx`` belongs to."""
    run = ctx.find_root().obj
    assert isinstance(run, Run)
    return run


def fail(run: Run | None, error: WeightshipError) -> NoReturn:
    """End the command on ``error``: one line on stderr (JSON under ``--json``) and its exit status."""
    code = next((c for cls, c in EXIT_CODES.items() if isinstance(error, cls)), 1)
    if run is not None and run.json:
        body = {"error": {"code": error.code, "message": cli_message(error)}}
        sys.stderr.write(json.dumps(body) + "\n")
    else:
        line = Text.assemble(("error:", "bold red"), " ", cli_message(error))  # messages are never markup
        Console(stderr=True, soft_wrap=True, highlight=False).print(line)
    raise typer.Exit(code)


def command(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn ``WeightshipError`` into one red line and an exit status."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        # typer hands commands the current click context, which is not always a ``typer.Context``.
        ctx = kwargs.get("ctx")
        run = ctx.find_root().obj if hasattr(ctx, "find_root") else None
        try:
            return fn(*args, **kwargs)
        except WeightshipError as exc:
            fail(run if isinstance(run, Run) else None, exc)
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            message = f"cannot read{where}: {exc.strerror or exc}; check the path exists and is readable"
            fail(run if isinstance(run, Run) else None, WeightshipError(message))

    return wrapper


def out(run: Run, data: Any, human: Callable[[], RenderableType | None]) -> None:
    """JSON for scripts, or the renderable ``human()`` builds for people."""
    if run.json:
        sys.stdout.write(json.dumps(jsonable(data), indent=2, sort_keys=True) + "\n")
        return
    renderable = human()
    if renderable is not None:
        display.console().print(renderable)


def jsonable(data: Any) -> Any:
    """``data`` with pydantic models turned into their JSON form, recursively."""
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, list | tuple):
        return [jsonable(x) for x in data]
    if isinstance(data, dict):
        return {k: jsonable(v) for k, v in data.items()}
    return data
