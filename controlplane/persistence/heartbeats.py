"""Storing heartbeats in batches: the statements ``controlplane.fleet`` group-commits.

A heartbeat is one ``UPDATE`` of its node's row: ``last_seen``, plus the whole report when it
differs from the one last written. A batch runs as at most two ``executemany`` (reports, then
bare touches) in the group commit's transaction (``controlplane.persistence.batch``). A row that
does not exist is not an error of the batch: that member alone learns its node is unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.engine import Connection

from controlplane.persistence.rows import NodeRow

__all__ = ["HeartbeatWrite", "store_heartbeats"]

# Built once: a heartbeat is the hottest write, and the ORM session path costs ~5x the statement.
_TOUCH = update(NodeRow).where(NodeRow.id == bindparam("node_id")).values(last_seen=bindparam("now"))
_REWRITE = _TOUCH.values(report=bindparam("report"))


@dataclass(frozen=True, slots=True)
class HeartbeatWrite:
    """One node's heartbeat as stored: when it was heard from and, when it changed, its report (JSON)."""

    node_id: str
    now: datetime
    report: dict[str, Any] | None


def store_heartbeats(conn: Connection, writes: Sequence[HeartbeatWrite]) -> list[bool]:
    """Apply ``writes`` on ``conn`` (inside its transaction); per write, whether its node exists."""
    rewrites = [{"node_id": w.node_id, "now": w.now, "report": w.report} for w in writes if w.report is not None]
    touches = [{"node_id": w.node_id, "now": w.now} for w in writes if w.report is None]
    stored = 0
    for statement, params in ((_REWRITE, rewrites), (_TOUCH, touches)):
        if params:
            stored += conn.execute(statement, params).rowcount
    if stored == len(writes) and conn.dialect.supports_sane_multi_rowcount:
        return [True] * len(writes)
    # Some node is unknown (or the driver cannot say how many rows changed): ask which exist.
    ids = {w.node_id for w in writes}
    known = set(conn.scalars(select(NodeRow.id).where(NodeRow.id.in_(ids))))
    return [w.node_id in known for w in writes]
