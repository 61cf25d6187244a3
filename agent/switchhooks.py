"""Switch hooks: telling an external model server (vLLM, TGI, SGLang, Triton) that its version moved.

A model server that is not ``weightship-serve`` does not ask the local API which version to
serve; it reads the weights from ``<data_dir>/deployments/<name>/current``. After the agent moves
that link (a promotion, a canary step, a rollback), the deployment's hook tells the server
(``agent.hookcalls``: run a command, send a signal, or POST to a URL).

Per deployment, one loop follows the link::

    link == record digest, ready, != announced  -> call the hook (one at a time, with a timeout)
        ok      -> announced := digest (persisted in state/switch-hooks.json)
        failed  -> call again after a capped, jittered backoff; a newer switch is announced at once
    link back on the announced digest           -> a failing announcement is moot: retries end,
                                                   the report is the last successful call again

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
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from agent.durable import atomic_write
from agent.epochs import EpochBook
from agent.hookcalls import SwitchHook, call
from agent.store import VersionStore
from weightship.backoff import DelaySequence
from weightship.errors import WeightshipError
from weightship.logs import event
from weightship.schemas import SwitchHookResult

__all__ = ["MAX_RETRY", "STATE_FILE", "SwitchHooks"]

log = logging.getLogger("agent.switchhooks")

#: where the digest each deployment's hook last announced is kept, under ``state/``
STATE_FILE = "switch-hooks.json"
#: longest wait between two calls of a failing hook
MAX_RETRY = 60.0
#: a loop re-checks its deployment at least this often even when nothing pokes it
RECHECK = 5.0


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
    #: the last call that succeeded (what the server was told most recently)
    last_ok: SwitchHookResult | None = None
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
                if result.ok:
                    follow.last_ok = result
                self.on_change()
                continue
            if target is not None and not due and follow.failing_digest is not None:
                # Moved back to what the server already serves: the failed announcement is moot.
                follow.backoff, follow.failing_digest, follow.last = None, None, follow.last_ok
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
        try:
            await asyncio.get_running_loop().run_in_executor(self.state_executor, atomic_write, self.path, data)
        except (OSError, WeightshipError) as exc:
            # Kept in memory: the only cost of a lost record is one more call after a restart.
            event(log, "hook.state_unsaved", logging.WARNING, path=str(self.path), error=repr(exc))

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
        fields = await call(hook, facts)
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


