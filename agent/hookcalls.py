"""Switch hooks: how one is configured, and one call of it (a command, a signal, an HTTP POST).

A hook tells an external model server that its deployment's ``current`` link moved
(``agent.switchhooks`` decides when). Three kinds:

- ``command``: run a program (argv, no shell), with ``WEIGHTSHIP_DEPLOYMENT``,
  ``WEIGHTSHIP_DIGEST``, ``WEIGHTSHIP_PATH`` (the version directory), ``WEIGHTSHIP_PREVIOUS_DIGEST``
  (the version the hook last announced, empty if none), ``WEIGHTSHIP_EPOCH`` and
  ``WEIGHTSHIP_MODEL`` in its environment; exit status 0 is success. It runs in a process group of
  its own, killed whole at the timeout; its stderr's tail is kept for the report.
- ``signal``: send a signal (default ``SIGHUP``) to the pid written in a pidfile.
- ``http``: ``POST`` the same facts as JSON (``deployment``, ``digest``, ``path``,
  ``previous_digest``, ``epoch``, ``model``) to a URL; any 2xx is success.

Configured as a flag (``--switch-hook NAME=command:PROGRAM ARGS``, ``NAME=signal:[SIG:]PIDFILE``,
``NAME=http://...``) or a config-file table (``[switch_hooks.NAME]`` with ``command``, ``signal`` +
``pidfile`` or ``http``, and ``timeout``). A call never raises: it returns the fields of its
``SwitchHookResult`` (``ok``, ``exit_code``/``http_status``, ``detail``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from weightship.errors import ValidationError
from weightship.manifest import check_model_name

__all__ = ["DEFAULT_TIMEOUT", "HOOK_KINDS", "SwitchHook", "call", "parse_hook", "parse_hook_flag"]

HOOK_KINDS = ("command", "signal", "http")
#: default seconds one call may take (a vLLM restart loads the whole model)
DEFAULT_TIMEOUT = 120.0
#: characters of stderr or of an HTTP answer kept in the report
EXCERPT = 400


@dataclass(frozen=True)
class SwitchHook:
    """How to tell one deployment's model server that its version moved."""

    deployment: str
    kind: str
    #: ``command``: the program and its arguments
    argv: tuple[str, ...] = ()
    #: ``signal``: which signal, to the pid in ``pidfile``
    signal: int = signal.SIGHUP
    pidfile: str = ""
    #: ``http``: the URL to POST to
    url: str = ""
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        check_model_name(self.deployment)
        where = f"switch hook of deployment {self.deployment!r}"
        if self.kind not in HOOK_KINDS:
            raise ValidationError(f"{where}: kind must be one of {', '.join(HOOK_KINDS)}, not {self.kind!r}")
        if self.kind == "command" and not self.argv:
            raise ValidationError(f"{where}: command is empty; give the program to run and its arguments")
        if self.kind == "signal" and not self.pidfile:
            raise ValidationError(f"{where}: a signal hook needs pidfile, the file holding the server's pid")
        if self.kind == "http" and not self.url.startswith(("http://", "https://")):
            raise ValidationError(f"{where}: http must be an http:// or https:// URL, not {self.url!r}")
        if not 0 < self.timeout <= 3600:
            raise ValidationError(f"{where}: timeout must be between 0 and 3600 seconds, not {self.timeout}")

    def describe(self) -> str:
        """One line for logs and errors."""
        if self.kind == "command":
            return "command " + shlex.join(self.argv)
        if self.kind == "signal":
            return f"signal {signal.Signals(self.signal).name} to the pid in {self.pidfile}"
        return f"POST {self.url}"


def _signal_number(value: object, where: str) -> int:
    text = str(value).strip().upper()
    if text.isascii() and text.isdigit():  # isdigit alone takes "²", which int refuses
        number = int(text)
    else:
        name = text if text.startswith("SIG") else f"SIG{text}"
        if name not in signal.Signals.__members__:
            raise ValidationError(f"{where}: unknown signal {value!r}; use a name such as SIGHUP or SIGUSR1")
        number = int(signal.Signals[name])
    if number not in {int(s) for s in signal.Signals}:
        raise ValidationError(f"{where}: unknown signal number {number}")
    return number


def parse_hook(deployment: str, value: object) -> SwitchHook:
    """A hook from a config file entry: a table (``command``/``signal``+``pidfile``/``http``, ``timeout``) or a flag string."""
    if isinstance(value, str):
        return parse_hook_flag(f"{deployment}={value}")
    where = f"switch hook of deployment {deployment!r}"
    if not isinstance(value, Mapping):
        raise ValidationError(f"{where}: expected a table with command, signal or http; got {type(value).__name__}")
    known = {"command", "signal", "pidfile", "http", "timeout"}
    unknown = set(value) - known
    if unknown:
        raise ValidationError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    kinds = [k for k in ("command", "http") if k in value] + (["signal"] if "pidfile" in value else [])
    if len(kinds) != 1:
        raise ValidationError(f"{where}: set exactly one of command, http, or pidfile (with signal)")
    try:
        timeout = float(value.get("timeout", DEFAULT_TIMEOUT))
    except (TypeError, ValueError):
        raise ValidationError(f"{where}: timeout must be a number of seconds") from None
    kind = kinds[0]
    if kind == "command":
        command = value["command"]
        if isinstance(command, str):
            argv = tuple(shlex.split(command))
        elif isinstance(command, list) and all(isinstance(a, str) for a in command):
            argv = tuple(command)
        else:
            raise ValidationError(f"{where}: command must be a string or a list of strings")
        return SwitchHook(deployment, "command", argv=argv, timeout=timeout)
    if kind == "signal":
        number = _signal_number(value.get("signal", "SIGHUP"), where)
        return SwitchHook(deployment, "signal", signal=number, pidfile=str(value["pidfile"]), timeout=timeout)
    return SwitchHook(deployment, "http", url=str(value["http"]), timeout=timeout)


def parse_hook_flag(text: str) -> SwitchHook:
    """``NAME=command:PROGRAM ARGS...``, ``NAME=signal:[SIG:]PIDFILE`` or ``NAME=http(s)://URL``."""
    name, sep, spec = text.partition("=")
    name = name.strip()
    if not sep or not name or not spec:
        raise ValidationError(
            f"switch hook {text!r} must be DEPLOYMENT=command:PROGRAM ARGS, DEPLOYMENT=signal:[SIGNAL:]PIDFILE "
            "or DEPLOYMENT=http://HOST:PORT/PATH (--switch-hook)"
        )
    if spec.startswith(("http://", "https://")):
        return parse_hook(name, {"http": spec})
    kind, _, rest = spec.partition(":")
    if kind == "command":
        return parse_hook(name, {"command": rest})
    if kind == "signal":
        first, colon, pidfile = rest.partition(":")
        if colon and not first.startswith(("/", ".")):
            return parse_hook(name, {"signal": first, "pidfile": pidfile})
        return parse_hook(name, {"pidfile": rest})
    raise ValidationError(
        f"switch hook of deployment {name!r}: {spec!r} is not command:..., signal:... or an http(s) URL (--switch-hook)"
    )


async def call(hook: SwitchHook, facts: Mapping[str, object]) -> dict[str, Any]:
    """Call ``hook`` once with ``facts`` (deployment, digest, path, previous_digest, epoch, model)."""
    if hook.kind == "command":
        return await run_command(hook, facts)
    if hook.kind == "signal":
        return send_signal(hook)
    return await post(hook, facts)


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= EXCERPT else "…" + text[-EXCERPT:]


async def run_command(hook: SwitchHook, facts: Mapping[str, object]) -> dict[str, Any]:
    env = {
        **os.environ,
        "WEIGHTSHIP_DEPLOYMENT": str(facts["deployment"]),
        "WEIGHTSHIP_DIGEST": str(facts["digest"]),
        "WEIGHTSHIP_PATH": str(facts["path"]),
        "WEIGHTSHIP_PREVIOUS_DIGEST": str(facts["previous_digest"]),
        "WEIGHTSHIP_EPOCH": str(facts["epoch"]),
        "WEIGHTSHIP_MODEL": str(facts["model"]),
    }
    try:
        proc = await asyncio.create_subprocess_exec(
            *hook.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout ends it and its children
        )
    except OSError as exc:
        return {"ok": False, "detail": f"cannot start {hook.argv[0]!r}: {exc.strerror or exc}; check the command"}
    try:
        _out, err = await asyncio.wait_for(proc.communicate(), hook.timeout)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        return {
            "ok": False,
            "exit_code": proc.returncode,
            "detail": f"timed out after {hook.timeout:g} s and was killed; raise the hook's timeout or make it faster",
        }
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            await asyncio.shield(proc.wait())
        raise
    code = proc.returncode
    if code == 0:
        return {"ok": True, "exit_code": 0}
    said = _excerpt(err or b"")
    return {"ok": False, "exit_code": code, "detail": f"exit {code}" + (f": {said}" if said else "")}


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def send_signal(hook: SwitchHook) -> dict[str, Any]:
    name = signal.Signals(hook.signal).name
    try:
        text = Path(hook.pidfile).read_text(encoding="utf-8").strip()
    except OSError as exc:
        return {"ok": False, "detail": f"cannot read pidfile {hook.pidfile}: {exc.strerror}; is the server running?"}
    if not (text.isascii() and text.isdigit()) or int(text) <= 1:
        return {"ok": False, "detail": f"pidfile {hook.pidfile} holds {text[:40]!r}, not a process id"}
    pid = int(text)
    try:
        os.kill(pid, hook.signal)
    except ProcessLookupError:
        return {"ok": False, "detail": f"no process {pid} (from {hook.pidfile}) to send {name} to; is the server running?"}
    except PermissionError:
        return {"ok": False, "detail": f"not allowed to send {name} to process {pid}; run the agent as the server's user"}
    return {"ok": True}


async def post(hook: SwitchHook, facts: Mapping[str, object]) -> dict[str, Any]:
    # A model server's own endpoint, not a weightship API: its answers are not problem details and
    # a call is never retried here (the loop's backoff does that), so plain httpx, not our HTTP core.
    body = json.dumps(dict(facts)).encode()
    try:
        async with httpx.AsyncClient(timeout=hook.timeout, follow_redirects=False, trust_env=False) as http:
            response = await asyncio.wait_for(
                http.post(hook.url, content=body, headers={"Content-Type": "application/json"}), hook.timeout
            )
    except (TimeoutError, httpx.TimeoutException):
        return {"ok": False, "detail": f"POST {hook.url} timed out after {hook.timeout:g} s"}
    except httpx.HTTPError as exc:
        return {"ok": False, "detail": f"POST {hook.url} failed: {exc!r}; is the server running?"}
    if response.is_success:
        return {"ok": True, "http_status": response.status_code}
    said = _excerpt(response.content)
    return {
        "ok": False,
        "http_status": response.status_code,
        "detail": f"HTTP {response.status_code}" + (f": {said}" if said else ""),
    }
