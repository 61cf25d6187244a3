"""Pins: the versions that model servers on this host ask for by digest, and hold while they serve them.

A model server pinned to one version (``weightship-serve --digest``, a Kubernetes pod made for that
version) and the init container that waits for it name the version by digest and their deployment
through the local API. Each such request leaves a pin::

    ask    GET /local/v1/versions/{digest}?deployment=D    lives ASK_SECONDS after the last ask
    lease  PUT /local/v1/leases/{holder}                    lives LocalLease.seconds after the last PUT;
                                                            DELETE ends it at once (a clean stop)

While a pin lives, its version is never evicted (``Reconciler.protected``), the agent follows its
deployment's desired state even when ``--deployment`` does not name it (re-registering with the
control plane, which then entitles the node to the pointer's versions), and stages the version
when that deployment's pointer names it (stable, previous stable or canary). A server that dies
stops renewing its lease and the pin lapses; so a version leaves the disk only once no server
holds it. Pins are also written to ``state/pins.json`` whenever the set of holders changes, and
an agent that restarts gives each stored pin a fresh lifetime, so a restart never evicts a
version a server still holds before the server renews its lease.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.durable import atomic_write
from weightship.logs import event

__all__ = ["ASK_SECONDS", "MAX_PINS", "Pin", "Pins"]

log = logging.getLogger("agent.pins")

#: how long an ask (a version asked for by digest, e.g. by a waiting init container) keeps its version
ASK_SECONDS = 120.0
#: most pins held at once (asks beyond it are answered, not remembered)
MAX_PINS = 1024


@dataclass(frozen=True, slots=True)
class Pin:
    """One live pin: ``holder`` (a server's lease id, or ``ask:<deployment>:<digest>``) holds ``digest``."""

    holder: str
    deployment: str | None
    digest: str
    expires: float
    lease: bool


class Pins:
    """The live pins; ``clock`` is monotonic seconds (a test seam). Used on the event loop only."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._pins: dict[str, Pin] = {}
        self._saved: frozenset[tuple[str, str | None, str, bool]] = frozenset()

    def load(self) -> None:
        """Read the pins a previous run stored; each gets a fresh lifetime from now."""
        if self.path is None or not self.path.exists():
            return
        try:
            stored = json.loads(self.path.read_text(encoding="utf-8"))
            for item in stored:
                self._put(
                    str(item["holder"]),
                    item.get("deployment"),
                    str(item["digest"]),
                    float(item["seconds"]),
                    bool(item["lease"]),
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            event(log, "pins.unreadable", logging.WARNING, path=str(self.path), error=repr(exc))
        self._saved = self._membership()
        event(log, "pins.loaded", pins=len(self._pins))

    def ask(self, deployment: str | None, digest: str) -> None:
        """A request for ``digest`` (of ``deployment``): hold it ``ASK_SECONDS`` from now."""
        self._put(f"ask:{deployment or '-'}:{digest}", deployment, digest, ASK_SECONDS, False)

    def lease(self, holder: str, deployment: str, digest: str, seconds: float) -> None:
        """``holder`` serves ``digest``: hold it ``seconds`` from now (a renewal just moves the end)."""
        self._put(f"lease:{holder}", deployment, digest, seconds, True)

    def release(self, holder: str) -> bool:
        """``holder`` stopped serving; whether it held a lease."""
        return self._pins.pop(f"lease:{holder}", None) is not None

    def _put(self, key: str, deployment: str | None, digest: str, seconds: float, lease: bool) -> None:
        if key not in self._pins and len(self._pins) >= MAX_PINS:
            self.prune()
            if len(self._pins) >= MAX_PINS:
                event(log, "pins.full", logging.WARNING, holder=key, digest=digest)
                return
        self._pins[key] = Pin(key, deployment, digest, self._clock() + seconds, lease)

    def prune(self) -> list[Pin]:
        """Drop the pins that lapsed; returns them."""
        now = self._clock()
        lapsed = [p for p in self._pins.values() if p.expires <= now]
        for pin in lapsed:
            del self._pins[pin.holder]
            event(log, "pins.lapsed", holder=pin.holder, digest=pin.digest, deployment=pin.deployment or "-")
        return lapsed

    def live(self) -> list[Pin]:
        """The pins that have not lapsed."""
        now = self._clock()
        return [p for p in self._pins.values() if p.expires > now]

    def digests(self) -> set[str]:
        """Versions some live pin holds: never evicted."""
        return {p.digest for p in self.live()}

    def deployments(self) -> set[str]:
        """Deployments some live pin names: followed even when not configured."""
        return {p.deployment for p in self.live() if p.deployment}

    def asked(self) -> dict[str, set[str]]:
        """Per deployment, the digests its live pins ask for."""
        found: dict[str, set[str]] = {}
        for pin in self.live():
            if pin.deployment:
                found.setdefault(pin.deployment, set()).add(pin.digest)
        return found

    def _membership(self) -> frozenset[tuple[str, str | None, str, bool]]:
        return frozenset((p.holder, p.deployment, p.digest, p.lease) for p in self.live())

    def to_save(self) -> bytes | None:
        """The bytes to store when the set of holders changed since the last save; ``None`` if it did not."""
        members = self._membership()
        if self.path is None or members == self._saved:
            return None
        self._saved = members
        now = self._clock()
        doc = [
            {
                "holder": p.holder,
                "deployment": p.deployment,
                "digest": p.digest,
                "lease": p.lease,
                "seconds": max(1.0, p.expires - now),
            }
            for p in sorted(self.live(), key=lambda p: p.holder)
        ]
        return json.dumps(doc, indent=1).encode()

    def save(self, data: bytes) -> None:
        """Write what ``to_save`` returned (in a worker thread)."""
        assert self.path is not None
        try:
            atomic_write(self.path, data)
        except OSError as exc:  # the pins still hold in memory; the next change writes them again
            event(log, "pins.save_failed", logging.WARNING, path=str(self.path), error=repr(exc))
