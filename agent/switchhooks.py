"""Switch hooks: telling an external model server (vLLM, TGI, SGLang, Triton) that its version moved.

A model server that is not ``weightship-serve`` does not ask the local API which version to
serve; it reads the weights from ``<data_dir>/deployments/<name>/current``. After the agent moves
that link (a promotion, a canary step, a rollback), the deployment's hook tells the server:

- ``command``: run a program (argv, no shell), with ``WEIGHTSHIP_DEPLOYMENT``,
  ``WEIGHTSHIP_DIGEST``, ``WEIGHTSHIP_PATH`` (the version directory), ``WEIGHTSHIP_PREVIOUS_DIGEST``
  (the version the hook last announced, empty if none) and ``WEIGHTSHIP_EPOCH`` in its environment;
  exit status 0 is success. Its stderr's tail is kept for the report.
- ``signal``: send a signal (default ``SIGHUP``) to the pid written in a pidfile.
- ``http``: ``POST`` the same facts as JSON (``deployment``, ``digest``, ``path``,
  ``previous_digest``, ``epoch``, ``model``) to a URL; any 2xx is success.

Per deployment, one loop follows the link::

    link == record digest, ready, != announced  -> call the hook (one at a time, with a timeout)
        ok      -> announced := digest (persisted in state/switch-hooks.json)
        failed  -> call again after a capped, jittered backoff; a newer switch is announced at once

The hook never moves the link: the link is swapped by the reconciler only to a version verified
on this node (``VersionStore.link_current`` refuses anything else), and a failing hook leaves it
where the switch put it, so a server that reloads by itself, or a later retry, still finds
verified bytes. ``announced`` survives restarts, so a switch whose hook did not complete before
the agent stopped is announced after it starts again; a deployment whose hook never succeeded on
this node (the first run with a hook) is announced once at start-up.

Each call's result (ok, or failed with the exit status or HTTP status and a short excerpt of what
the server said, and how long it took) is reported in the heartbeat (``DeploymentState.hook``),
in the local API's ``/status``, as a health error while it keeps failing, and as metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from agent.durable import atomic_write
from agent.epochs import EpochBook
from agent.store import VersionStore
from weightship.backoff import DelaySequence
from weightship.errors import ValidationError
from weightship.logs import event
from weightship.manifest import check_model_name
from weightship.schemas import SwitchHookResult

__all__ = ["DEFAULT_TIMEOUT", "HOOK_KINDS", "STATE_FILE", "SwitchHook", "SwitchHooks", "parse_hook", "parse_hook_flag"]

log = logging.getLogger("agent.switchhooks")

HOOK_KINDS = ("command", "signal", "http")
#: where the digest each deployment's hook last announced is kept, under ``state/``
STATE_FILE = "switch-hooks.json"
#: default seconds one call may take (a vLLM restart loads the whole model)
DEFAULT_TIMEOUT = 120.0
#: characters of stderr or of an HTTP answer kept in the report
EXCERPT = 400
#: longest wait between two calls of a failing hook
MAX_RETRY = 60.0
#: a loop re-checks its deployment at least this often even when nothing pokes it
RECHECK = 5.0


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
    if text.isdigit():
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


@dataclass(frozen=True, slots=True)
class _Target:
    digest: str
    epoch: int
    model: str
    path: Path


@dataclass
class _Follow:
    """One deployment's hook state."""

    hook: SwitchHook
    announced: str | None
    last: SwitchHookResult | None = None
    backoff: DelaySequence | None = None
    failing_digest: str | None = None
    calls: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class SwitchHooks:
    """Calls each deployment's switch hook after its ``current`` link moved, until the call succeeds."""

    def __init__(
        self,
        hooks: Mapping[str, SwitchHook],
        store: VersionStore,
        book: EpochBook,
        state_executor: Executor,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = MAX_RETRY,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.book = book
        self.state_executor = state_executor
        self.backoff_initial = backoff_initial
        self.backoff_max = max(backoff_max, backoff_initial)
        self.on_change = on_change
        self.path = store.state_dir / STATE_FILE
        announced = self._load()
        self._follows = {name: _Follow(hook, announced.get(name)) for name, hook in sorted(hooks.items())}

    def _load(self) -> dict[str, str]:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            event(log, "hook.state_unreadable", logging.WARNING, path=str(self.path), error=repr(exc))
            return {}
        found = doc.get("announced", {}) if isinstance(doc, dict) else {}
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}

    # --- views ---------------------------------------------------------------------------------

    def result(self, deployment: str) -> SwitchHookResult | None:
        """The last call of ``deployment``'s hook, if it has one and it was called."""
        follow = self._follows.get(deployment)
        return follow.last if follow else None

    def errors(self) -> list[str]:
        """One line per deployment whose hook keeps failing, for the heartbeat's health."""
        lines = []
        for name, follow in self._follows.items():
            last = follow.last
            if last is not None and not last.ok:
                retry = f"; retries at {last.retry_at:%H:%M:%S} UTC" if last.retry_at else ""
                lines.append(
                    f"switch hook of deployment {name} ({follow.hook.describe()}) failed for {last.digest} "
                    f"({last.attempts} attempt{'s' if last.attempts != 1 else ''}): {last.detail}{retry}"
                )
        return lines

    def metrics(self) -> str:
        """Prometheus text: calls by outcome, whether each hook is failing, the last call's duration, what was announced."""
        if not self._follows:
            return ""
        out = [
            "# HELP weightship_agent_switch_hook_calls_total Switch hook calls by deployment and outcome.",
            "# TYPE weightship_agent_switch_hook_calls_total counter",
        ]
        for name, follow in self._follows.items():
            for outcome, count in follow.calls.items():
                out.append(f'weightship_agent_switch_hook_calls_total{{deployment="{name}",outcome="{outcome}"}} {count}')
        out += [
            "# HELP weightship_agent_switch_hook_failing 1 while the deployment's last hook call failed.",
            "# TYPE weightship_agent_switch_hook_failing gauge",
        ]
        for name, follow in self._follows.items():
            failing = int(follow.last is not None and not follow.last.ok)
            out.append(f'weightship_agent_switch_hook_failing{{deployment="{name}"}} {failing}')
        out += [
            "# HELP weightship_agent_switch_hook_seconds How long the deployment's last hook call took.",
            "# TYPE weightship_agent_switch_hook_seconds gauge",
        ]
        for name, follow in self._follows.items():
            if follow.last is not None:
                out.append(f'weightship_agent_switch_hook_seconds{{deployment="{name}"}} {follow.last.seconds:.6f}')
        out += [
            "# HELP weightship_agent_announced_version_info The version the deployment's hook last announced successfully.",
            "# TYPE weightship_agent_announced_version_info gauge",
        ]
        for name, follow in self._follows.items():
            if follow.announced:
                out.append(f'weightship_agent_announced_version_info{{deployment="{name}",digest="{follow.announced}"}} 1')
        return "\n".join(out) + "\n"

    # --- running -------------------------------------------------------------------------------

    def poke(self) -> None:
        """Something changed (a switch among others): every loop looks at its deployment again."""
        for follow in self._follows.values():
            follow.wake.set()

    async def run(self) -> None:
        """Follow every deployment with a hook; runs until cancelled."""
        if not self._follows:
            await asyncio.Event().wait()
        async with asyncio.TaskGroup() as group:
            for name, follow in self._follows.items():
                group.create_task(self._follow(name, follow), name=f"switch-hook {name}")

    def _target(self, name: str) -> _Target | None:
        """What the link serves, once the record and the link agree on a ready version."""
        record = self.book.get(name)
        if record is None or record.digest is None:
            return None
        if self.store.current(name) != record.digest or not self.store.is_ready(record.digest):
            return None  # mid-switch: the record moved, the link follows in a moment
        return _Target(record.digest, record.applied_epoch, record.model or "", self.store.path(record.digest))

    async def _follow(self, name: str, follow: _Follow) -> None:
        loop = asyncio.get_running_loop()
        retry_at = 0.0
        while True:
            follow.wake.clear()
            target = self._target(name)
            due = target is not None and target.digest != follow.announced
            if due and target is not None and loop.time() >= retry_at:
                if follow.failing_digest != target.digest:
                    follow.backoff, follow.failing_digest = None, None  # a new switch: announce it now
                result = await self._call(follow, target)
                if result.ok:
                    follow.announced = target.digest
                    follow.backoff, follow.failing_digest = None, None
                    await self._save()
                    retry_at = 0.0
                else:
                    follow.backoff = follow.backoff or DelaySequence(self.backoff_initial, self.backoff_max)
                    follow.failing_digest = target.digest
                    delay = follow.backoff.next_delay()
                    retry_at = loop.time() + delay
                    result = result.model_copy(
                        update={
                            "attempts": follow.backoff.attempts,
                            "retry_at": datetime.now(UTC) + timedelta(seconds=delay),
                        }
                    )
                    event(
                        log,
                        "hook.failed",
                        logging.WARNING,
                        deployment=name,
                        digest=target.digest,
                        kind=follow.hook.kind,
                        detail=result.detail,
                        attempts=result.attempts,
                        retry_in=f"{delay:.2f}",
                    )
                follow.last = result
                self.on_change()
                continue
            if target is not None and not due and follow.failing_digest is not None:
                # Moved back to what the server already serves: the failed announcement is moot.
                follow.backoff, follow.failing_digest, follow.last = None, None, None
                retry_at = 0.0
                self.on_change()
            wait = RECHECK
            if due:
                wait = min(wait, max(0.0, retry_at - loop.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(follow.wake.wait(), wait)
            if follow.wake.is_set():
                newer = self._target(name)
                if newer is not None and newer.digest != follow.failing_digest:
                    retry_at = 0.0  # a different version to announce: no backoff from the old one

    async def _save(self) -> None:
        doc = {"version": 1, "announced": {n: f.announced for n, f in self._follows.items() if f.announced}}
        data = json.dumps(doc, sort_keys=True, indent=1).encode()
        await asyncio.get_running_loop().run_in_executor(self.state_executor, atomic_write, self.path, data)

    async def _call(self, follow: _Follow, target: _Target) -> SwitchHookResult:
        hook = follow.hook
        facts = {
            "deployment": hook.deployment,
            "digest": target.digest,
            "path": str(target.path),
            "previous_digest": follow.announced or "",
            "epoch": target.epoch,
            "model": target.model,
        }
        began = time.monotonic()
        at = datetime.now(UTC)
        fields: dict[str, Any]
        if hook.kind == "command":
            fields = await _run_command(hook, facts)
        elif hook.kind == "signal":
            fields = _send_signal(hook)
        else:
            fields = await _post(hook, facts)
        seconds = time.monotonic() - began
        result = SwitchHookResult(
            kind=hook.kind, digest=target.digest, epoch=target.epoch, seconds=seconds, at=at, **fields
        )
        follow.calls["ok" if result.ok else "failed"] += 1
        if result.ok:
            event(
                log,
                "hook.called",
                deployment=hook.deployment,
                digest=target.digest,
                epoch=target.epoch,
                kind=hook.kind,
                previous=facts["previous_digest"] or None,
                seconds=f"{seconds:.3f}",
            )
        return result


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= EXCERPT else "…" + text[-EXCERPT:]


async def _run_command(hook: SwitchHook, facts: Mapping[str, object]) -> dict[str, Any]:
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


def _send_signal(hook: SwitchHook) -> dict[str, Any]:
    name = signal.Signals(hook.signal).name
    try:
        text = Path(hook.pidfile).read_text(encoding="utf-8").strip()
    except OSError as exc:
        return {"ok": False, "detail": f"cannot read pidfile {hook.pidfile}: {exc.strerror}; is the server running?"}
    if not text.isdigit() or int(text) <= 1:
        return {"ok": False, "detail": f"pidfile {hook.pidfile} holds {text[:40]!r}, not a process id"}
    pid = int(text)
    try:
        os.kill(pid, hook.signal)
    except ProcessLookupError:
        return {"ok": False, "detail": f"no process {pid} (from {hook.pidfile}) to send {name} to; is the server running?"}
    except PermissionError:
        return {"ok": False, "detail": f"not allowed to send {name} to process {pid}; run the agent as the server's user"}
    return {"ok": True}


async def _post(hook: SwitchHook, facts: Mapping[str, object]) -> dict[str, Any]:
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
