"""Reconcile: turning the desired state into what this node holds on disk and serves.

Per deployment, a pointer from the control plane (epoch ``E``, digest ``D``)::

    E lower than an epoch already accepted  -> refused: reported in the heartbeat, nothing moves
    D ready on disk                         -> switch: record (E, D), then swap the ``current`` link
                                               (a D not served now must pass the signing policy
                                               in effect first, as a fetch would: nothing is fetched)
    D not on disk                           -> fetch D, keep serving the current version meanwhile,
                                               switch once D is ready (if it is still wanted)

Per version (the heartbeat's inventory)::

    absent --wanted--> fetching --all chunks verified, renamed into versions/--> ready
                         |   ^                                                   |
                   error v   | retry with backoff, or at the next desired state  | unreferenced and
                       failed                                                    v room needed
                                                                              evicted (LRU)

A failed fetch is tried again after a capped exponential backoff (seconds), except when the
origin's copy itself is bad (``CorruptChunkError``: a chunk's bytes never matched, however
often they were fetched) or the node's signing policy refuses the version (``SignatureRefused``,
checked before any byte is fetched: ``agent.signatures``): then the version waits ``corrupt_retry`` (minutes, growing to an
hour), because fetching the same bad bytes again only burns bandwidth. Either way a new desired
state naming the version (e.g. the operator re-points the deployment once the origin is fixed)
retries it at once, and so does a change of the signing policy for a version it refused (the
version remembers the policy generation it was refused under; the gate's has moved on). Each
version's run of failures (why, since when, how many, when next) is reported in the heartbeat as
a ``FetchProblem``.

A digest is fetched once however many deployments want it (single flight), and a fetch that
is no longer wanted is cancelled (its verified chunks stay in staging for later). Once every
deployment's served version is ready, the other versions in ``keep`` (previous stable, canary)
are prefetched one at a time, so a rollback or a promotion downloads nothing.

**Staged versions** (the desired state's ``stage``: a preheat or a warm pool) are fetched and
verified the same way, one at a time after the served and kept versions, protected from
eviction while they are named, and reported in the inventory like any version on disk
(``ready`` = verified here); they are never linked as ``current``: nothing serves them until a
pointer names them, and then the switch downloads nothing.

**Pinned versions** (``agent.pins``: versions local model servers ask for by digest, and hold
while they serve them) are staged the same way, before the kept versions, when the pointer of the
deployment they were asked for names them (stable, previous stable or canary: what the node is
entitled to fetch); they are never evicted while a pin holds them. ``describe`` says where such a
version stands (ready, fetching, failed, or unknown with the reason).
Decisions run on the event loop; every disk write (epochs, ``current`` links, the LRU record,
evictions) goes to a worker pool (``state_executor``), so local-API requests and heartbeats never
wait behind an fsync. Writes of the epoch book are made one at a time (an ``asyncio.Lock``, which
parks coroutines, not the loop) and each is awaited before the step that depends on it: a pointer
is durable before it is acted on, and a switch is recorded before the link moves.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from agent.assemble import Assembler, Progress
from agent.epochs import EpochBook, StaleEpochError
from agent.fetcher import CorruptChunkError
from agent.pins import Pins
from agent.rangeclient import UrlRejected
from agent.retention import Retention
from agent.serving import Serving
from agent.store import VersionStore
from weightship.backoff import DelaySequence
from weightship.errors import DiskFullError, StoreError, TemporaryError, WeightshipError
from weightship.logs import event
from weightship.schemas import (
    DesiredState,
    FetchFailure,
    FetchProblem,
    LocalVersion,
    LocalVersionState,
    StagedVersion,
    VersionInventory,
    VersionState,
)
from weightship.signing import SignatureRefused

__all__ = ["Reconciler", "Target"]

log = logging.getLogger("agent.reconcile")
_R = TypeVar("_R")

#: failures that fetching again cannot cure until someone fixes the origin or signs the version
_SLOW_RETRY = frozenset({FetchFailure.corrupt_origin, FetchFailure.signature_refused})
#: refusals kept for the heartbeat
MAX_REFUSED = 32
#: first and longest wait before a version whose origin copy is corrupt is fetched again
CORRUPT_RETRY = (300.0, 3600.0)
#: longest error message carried in a heartbeat
MAX_MESSAGE = 2000


@dataclass(frozen=True, slots=True)
class Target:
    """What one deployment should serve here, from the latest accepted pointer."""

    name: str
    model: str
    digest: str | None
    epoch: int
    keep: tuple[str, ...]


@dataclass
class _Version:
    """A version being fetched, or whose fetch failed."""

    digest: str
    model: str
    progress: Progress = field(default_factory=Progress)
    task: asyncio.Task[None] | None = None
    error: str | None = None
    retry_at: float = 0.0
    backoff: DelaySequence | None = None
    #: the last failed attempt, when this run of failures began, and how many attempts failed in it
    failure: Exception | None = None
    since: datetime | None = None
    failures: int = 0
    retry_wall: datetime | None = None
    #: the signing policy generation the last attempt was refused under (``None``: not refused)
    refused_under: int | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def problem(self) -> FetchProblem | None:
        """Why this version is retrying or failed, for the heartbeat; ``None`` while all goes well."""
        trouble, at = self.progress.trouble, self.progress.trouble_at
        if self.running and trouble is not None and at is not None:
            error: Exception = trouble
            since = self.since or at
        elif self.failure is not None and self.since is not None:
            error, since = self.failure, self.since
        else:
            return None
        corrupt = error if isinstance(error, CorruptChunkError) else None
        return FetchProblem(
            reason=failure_reason(error),
            message=_message(error)[:MAX_MESSAGE],
            since=since,
            attempts=self.failures,
            retry_at=None if self.running else self.retry_wall,
            blob=corrupt.blob if corrupt else None,
            file=corrupt.file[:1024] if corrupt else None,
            chunk_index=corrupt.chunk_index if corrupt else None,
            chunk_digest=corrupt.chunk_digest if corrupt else None,
            chunk_attempts=corrupt.rejected if corrupt else 0,
        )


def failure_reason(error: Exception) -> FetchFailure:
    """What kind of failure ``error`` is, as the heartbeat reports it."""
    if isinstance(error, CorruptChunkError):
        return FetchFailure.corrupt_origin
    if isinstance(error, SignatureRefused):
        return FetchFailure.signature_refused
    if isinstance(error, DiskFullError):
        return FetchFailure.disk_full
    if isinstance(error, (StoreError, TemporaryError, UrlRejected)):
        return FetchFailure.origin_unavailable
    return FetchFailure.error


def _message(error: Exception) -> str:
    return error.message if isinstance(error, WeightshipError) else f"{type(error).__name__}: {error}"


class Reconciler:
    """Drives fetches and switches towards the accepted desired state."""

    def __init__(
        self,
        store: VersionStore,
        book: EpochBook,
        serving: Serving,
        assembler: Assembler,
        retention: Retention,
        executor: Executor,
        *,
        state_executor: Executor | None = None,
        prefetch: bool = True,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        corrupt_retry: tuple[float, float] = CORRUPT_RETRY,
        on_change: Callable[[], None] = lambda: None,
        pins: Pins | None = None,
    ) -> None:
        self.store = store
        #: versions local model servers ask for and hold (``agent.pins``)
        self.pins = pins or Pins()
        self.book = book
        self.serving = serving
        self.assembler = assembler
        self.retention = retention
        self.executor = executor
        self.state_executor = state_executor or executor
        self.prefetch = prefetch
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.corrupt_retry = corrupt_retry
        self.on_change = on_change
        self._targets: dict[str, Target] = {}
        #: versions to hold verified without serving, by digest -> model
        self._stage: dict[str, str] = {}
        self._versions: dict[str, _Version] = {}
        self._refused: deque[str] = deque(maxlen=MAX_REFUSED)
        self._refused_seen: set[tuple[str, int, str | None]] = set()
        self._referenced: frozenset[str] = frozenset()
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._book_writes = asyncio.Lock()
        #: whether a desired state arrived since this agent started
        self._received = False

    async def _io(self, fn: Callable[..., _R], *args: object) -> _R:
        """Run a disk step in the state pool and wait for it without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.state_executor, fn, *args)

    # --- inputs --------------------------------------------------------------------------------

    async def apply(self, desired: DesiredState) -> None:
        """Accept the pointers of ``desired`` that are not stale (durably), and wake the loop."""
        targets: dict[str, Target] = {}
        for item in desired.deployments:
            try:
                async with self._book_writes:
                    await self._io(self.book.accept, item.name, item.epoch, item.model, item.digest)
            except StaleEpochError as exc:
                self._refuse(item.name, item.epoch, item.digest, exc)
                if item.name in self._targets:
                    targets[item.name] = self._targets[item.name]
                continue
            targets[item.name] = Target(item.name, item.model, item.digest, item.epoch, tuple(item.keep))
        for target in targets.values():
            if self._targets.get(target.name) != target:
                self._retry_now(target)
        self._targets = targets
        self._received = True
        self._apply_stage(desired.stage)
        self._wake.set()

    def wake(self) -> None:
        """Reconcile soon (a local server asked for a version, or a pin lapsed)."""
        self._wake.set()

    def _apply_stage(self, stage: list[StagedVersion]) -> None:
        staged = {s.digest: s.model for s in stage}
        if staged != self._stage:
            for digest in staged.keys() - self._stage.keys():
                version = self._versions.get(digest)
                if version is not None and not version.running and version.error is not None:
                    version.retry_at = 0.0  # newly asked for: a failed fetch is retried at once
                    version.retry_wall = None
            event(log, "stage.received", versions=",".join(sorted(staged)) or "none")
        self._stage = staged

    def _retry_now(self, target: Target) -> None:
        """A new desired state names these versions: a failed fetch of any of them is retried at once."""
        for digest in (target.digest, *target.keep):
            version = self._versions.get(digest) if digest else None
            if version is not None and not version.running and version.error is not None and version.retry_at:
                version.retry_at = 0.0
                version.retry_wall = None
                event(log, "fetch.retry_now", digest=digest, deployment=target.name, epoch=target.epoch)

    def _refuse(self, name: str, epoch: int, digest: str | None, exc: StaleEpochError) -> None:
        record = self.book.get(name)
        accepted = record.accepted_epoch if record else 0
        key = (name, epoch, digest)
        if key not in self._refused_seen:
            self._refused_seen.add(key)
            self._refused.append(
                f"deployment={name} epoch={epoch} digest={digest}: lower than accepted epoch {accepted}; refused"
            )
            event(
                log,
                "deploy.refused",
                logging.WARNING,
                deployment=name,
                epoch=epoch,
                accepted_epoch=accepted,
                digest=digest,
                reason=exc.code,
            )
            self.on_change()

    # --- views ---------------------------------------------------------------------------------

    def protected(self) -> set[str]:
        """Digests retention must never delete: served, wanted, kept, or being fetched."""
        found = {r.digest for r in self.book.records() if r.digest}
        for target in self._targets.values():
            if target.digest:
                found.add(target.digest)
            found.update(target.keep)
        return found | set(self._stage) | self.active() | self.pins.digests()

    def active(self) -> set[str]:
        """Digests being fetched right now."""
        return {d for d, v in self._versions.items() if v.running}

    def inventory(self) -> list[VersionInventory]:
        """Every version on this node: ready, fetching (with bytes so far) or failed (with why)."""
        ready = {d: m for d, m in self.store.ready().items() if not self._refused_on_disk(d)}
        items = [
            VersionInventory(digest=d, state=VersionState.ready, bytes_total=m.total_size, bytes_present=m.total_size)
            for d, m in sorted(ready.items())
        ]
        for digest, version in sorted(self._versions.items()):
            if digest in ready or (not version.running and version.error is None):
                continue
            items.append(
                VersionInventory(
                    digest=digest,
                    state=VersionState.fetching if version.running else VersionState.failed,
                    bytes_total=version.progress.bytes_total,
                    bytes_present=version.progress.bytes_present,
                    error=None if version.running else version.error,
                    problem=version.problem(),
                )
            )
        return items

    def describe(self, digest: str, deployment: str | None) -> LocalVersion:
        """Where ``digest`` (asked for as a version of ``deployment``) stands on this node, and why."""
        manifest = self.store.ready().get(digest)
        if manifest is not None and not self._refused_on_disk(digest):
            size = manifest.total_size
            path = str(self.store.path(digest))
            return LocalVersion(
                digest=digest, deployment=deployment, state=LocalVersionState.ready, path=path,
                bytes_total=size, bytes_present=size,
            )  # fmt: skip
        version = self._versions.get(digest)
        if version is not None and (version.running or version.error is not None):
            problem = version.problem()
            reason = f"{problem.reason.value}: {problem.message}" if problem is not None else ""
            return LocalVersion(
                digest=digest,
                deployment=deployment,
                state=LocalVersionState.fetching if version.running else LocalVersionState.failed,
                reason=reason or (version.error or ""),
                bytes_total=version.progress.bytes_total,
                bytes_present=version.progress.bytes_present,
            )
        state, reason = self._why_not(digest, deployment)
        return LocalVersion(digest=digest, deployment=deployment, state=state, reason=reason[:4096])

    def _refused_on_disk(self, digest: str) -> bool:
        """Whether ``digest`` is on disk but its last check against the signing policy failed (it is not served)."""
        version = self._versions.get(digest)
        return version is not None and not version.running and version.error is not None and self.store.is_ready(digest)

    def _why_not(self, digest: str, deployment: str | None) -> tuple[LocalVersionState, str]:
        """Why ``digest`` is neither on disk nor being fetched: queued, not named, or nothing known yet."""
        if digest in self._stage:
            return LocalVersionState.fetching, "staged by the control plane (a preheat or a warm pool); queued"
        if deployment is None:
            return LocalVersionState.unknown, (
                f"{digest} is not on this node and no deployment was named; ask with ?deployment=NAME so the "
                "agent follows that deployment and stages the version its pointer names"
            )
        target = self._targets.get(deployment)
        if target is None:
            waiting = "no desired state has arrived yet" if not self._received else "its desired state names none"
            return LocalVersionState.unknown, (
                f"this node has no pointer for deployment {deployment!r} ({waiting}): the agent follows it now "
                "that a local server asked for it and stages the version once the control plane names it; if this "
                "lasts, check that the deployment exists ('weightship deployment list'), that its pointer is set, "
                "and that the agent reaches the control plane"
            )
        named = {d for d in (target.digest, *target.keep) if d}
        if digest in named:
            return LocalVersionState.fetching, (
                f"deployment {deployment!r}'s pointer (epoch {target.epoch}) names it; queued behind the other "
                "versions this node fetches"
            )
        return LocalVersionState.unknown, (
            f"deployment {deployment!r}'s pointer (epoch {target.epoch}) names {', '.join(sorted(named)) or 'nothing'}, "
            f"not {digest}, so this node may not fetch it: point the deployment at it (stable or canary, e.g. "
            "'weightship deploy' or a ModelRollout), or run this server with a digest the pointer names"
        )

    def errors(self) -> list[str]:
        """What is wrong right now (failed fetches), for the heartbeat's health."""
        return [v.error for _d, v in sorted(self._versions.items()) if v.error and not v.running]

    def refused(self) -> list[str]:
        """Pointers refused recently (oldest first)."""
        return list(self._refused)

    # --- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile whenever woken; runs until cancelled."""
        await self._repair_links()
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._tick()
            except WeightshipError as exc:
                event(log, "reconcile.failed", logging.ERROR, error=exc.message)
                self._wake_at(asyncio.get_running_loop().time() + 1.0)
            except OSError as exc:
                event(log, "reconcile.failed", logging.ERROR, error=repr(exc))
                self._wake_at(asyncio.get_running_loop().time() + 1.0)

    async def _repair_links(self) -> None:
        # The record is written before the link is swapped; after a crash between the two, the
        # record wins.
        for record in self.book.records():
            if (
                record.digest
                and self.store.is_ready(record.digest)
                and self.store.current(record.name) != record.digest
            ):
                await self._io(self.store.link_current, record.name, record.digest)
                event(log, "deploy.link_repaired", deployment=record.name, digest=record.digest)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        serving_fetches = False
        for target in list(self._targets.values()):
            if target.digest is None:
                continue
            if self.store.is_ready(target.digest) and (self._serving(target) or self.assembler.cleared(target.digest)):
                await self._switch(target)
            else:  # fetched, or (on disk already) checked against the signing policy in effect
                serving_fetches |= self._want(target.model, target.digest, now)
        wanted = {t.digest for t in self._targets.values() if t.digest}
        # What local servers asked for first (they wait for it), then what the pointers keep.
        kept = [(m, d) for m, d in self._asked() if d not in wanted]
        if self.prefetch:
            kept += [(t.model, d) for t in self._targets.values() for d in t.keep if d not in wanted]
        if not serving_fetches:
            for model, digest in kept:  # one at a time, after what is served
                if not self.store.is_ready(digest) and self._want(model, digest, now):
                    break
        wanted |= {d for _m, d in kept}
        staged = [(model, d) for d, model in self._stage.items() if d not in wanted]
        if not serving_fetches and not any(self._versions[d].running for d in wanted if d in self._versions):
            for model, digest in staged:  # one at a time, after what is served and kept
                if not self.store.is_ready(digest) and self._want(model, digest, now):
                    break
        wanted |= {d for _m, d in staged}
        for digest, version in list(self._versions.items()):
            if digest not in wanted:
                if version.running:
                    assert version.task is not None
                    version.task.cancel()
                else:
                    del self._versions[digest]
        referenced = frozenset(d for d in self.protected() if self.store.is_ready(d))
        if referenced != self._referenced:
            self._referenced = referenced
            await self._io(self.store.touch, sorted(referenced))
        evicted = await loop.run_in_executor(self.executor, self.retention.trim, self.protected())
        if evicted:
            self.on_change()

    def _asked(self) -> list[tuple[str, str]]:
        """(model, digest) of each version a live pin asks for that its deployment's pointer names."""
        found = []
        for name, digests in sorted(self.pins.asked().items()):
            target = self._targets.get(name)
            if target is not None:
                named = {target.digest, *target.keep}
                found += [(target.model, d) for d in sorted(digests) if d in named]
        return found

    def _want(self, model: str, digest: str, now: float) -> bool:
        """Make sure ``digest`` is being fetched (unless it failed recently); whether it is now."""
        version = self._versions.get(digest)
        if version is not None and version.running:
            return True
        if version is not None and version.error is not None and now < version.retry_at:
            if not self._policy_moved(version):
                self._wake_at(version.retry_at)
                return False
            event(log, "fetch.retry_now", digest=digest, reason="signing_policy_changed")
        if version is None:
            version = self._versions[digest] = _Version(digest=digest, model=model)
        version.task = asyncio.get_running_loop().create_task(self._fetch(version), name=f"fetch {digest}")
        self.on_change()
        return True

    def _policy_moved(self, version: _Version) -> bool:
        """Whether ``version`` was refused under a signing policy older than the one in effect."""
        gate = self.assembler.gate
        return gate is not None and version.refused_under is not None and version.refused_under != gate.generation

    async def _fetch(self, version: _Version) -> None:
        try:
            await self.assembler.assemble(version.model, version.digest, version.progress)
        except asyncio.CancelledError:
            event(log, "fetch.cancelled", digest=version.digest, bytes_present=version.progress.bytes_present)
            self._versions.pop(version.digest, None)
            raise
        except Exception as exc:  # any failure is reported, never fatal to the agent
            message = _message(exc)
            reason = failure_reason(exc)
            if reason in _SLOW_RETRY:  # the same bad bytes or signatures again: only wait longer
                if version.failure is None or failure_reason(version.failure) != reason:
                    version.backoff = DelaySequence(*self.corrupt_retry)
            elif version.failure is not None and failure_reason(version.failure) in _SLOW_RETRY:
                version.backoff = None  # no longer the origin's bytes: back to the short backoff
            version.backoff = version.backoff or DelaySequence(self.backoff_initial, max(self.backoff_max, 1.0))
            delay = version.backoff.next_delay()
            now = datetime.now(UTC)
            version.error = message
            version.failure = exc
            gate = self.assembler.gate
            refused = reason == FetchFailure.signature_refused
            version.refused_under = gate.generation if gate is not None and refused else None
            version.failures += 1
            version.since = version.since or (version.progress.trouble_at or now)
            version.retry_at = asyncio.get_running_loop().time() + delay
            version.retry_wall = now + timedelta(seconds=delay)
            event(
                log,
                "fetch.failed",
                logging.ERROR,
                digest=version.digest,
                reason=reason.value,
                error=message,
                attempts=version.failures,
                retry_in=f"{delay:.2f}",
                error_type=type(exc).__name__,
            )
            self._wake_at(version.retry_at)
        else:
            self._versions.pop(version.digest, None)
        finally:
            self._wake.set()
            self.serving.poke()  # a version asked for by digest is ready now, or failed
            self.on_change()

    def _serving(self, target: Target) -> bool:
        """Whether ``target``'s deployment serves its version already (a new epoch only is recorded)."""
        record = self.book.get(target.name)
        return record is not None and record.digest == target.digest and self.store.current(target.name) == target.digest

    async def _switch(self, target: Target) -> None:
        assert target.digest is not None
        record = self.book.get(target.name)
        linked = self.store.current(target.name)
        if (
            record
            and record.applied_epoch == target.epoch
            and record.digest == target.digest
            and linked == target.digest
        ):
            return
        previous = record.digest if record else None
        async with self._book_writes:
            await self._io(self.book.apply, target.name, target.epoch, target.digest, target.model)
        if linked != target.digest:
            await self._io(self.store.link_current, target.name, target.digest)
        await self.serving.changed()
        self.on_change()
        event(
            log,
            "deploy.switched" if previous != target.digest else "deploy.epoch_applied",
            deployment=target.name,
            digest=target.digest,
            epoch=target.epoch,
            previous=previous,
        )

    def _wake_at(self, when: float) -> None:
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(when, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self._wake.set()
