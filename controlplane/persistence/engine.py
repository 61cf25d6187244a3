"""Engines and sessions for the control plane's database: bounded waits, a guarded SQLite file, a query count.

``make_engine`` builds an engine for SQLite or PostgreSQL whose every wait is bounded;
``database_errors`` maps SQLAlchemy's connection-level failures to ``DatabaseUnavailable`` (503).
The tables themselves: ``controlplane.persistence.rows``.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import create_engine, exc
from sqlalchemy import event as sql_events
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from weightship.errors import DatabaseUnavailable
from weightship.logs import event

__all__ = [
    "DatabaseFileGuard",
    "QueryCounter",
    "database_errors",
    "make_engine",
    "make_sessionmaker",
    "query_count",
]

log = logging.getLogger(__name__)

#: defaults of ``make_engine``'s bounds, the same as ``Settings``' (seconds, connections)
LOCK_TIMEOUT = 2.0
POOL_TIMEOUT = 3.0
POOL_SIZE = 10
STATEMENT_TIMEOUT = 30.0


class DatabaseFileGuard:
    """The identity (device, inode) of the SQLite file an engine opened, checked on every use.

    SQLite keeps writing to a file that was deleted or replaced under it (its open descriptors
    still point at the old inode), so without this check writes would be acknowledged and then
    lost on the next start. Every connection checkout and every commit compare the path's
    identity with the one recorded at start: a missing or different file raises
    ``DatabaseUnavailable`` (503), so ``/readyz`` fails and nothing more is acknowledged.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.identity = self._stat()
        if self.identity is None:
            raise DatabaseUnavailable(f"SQLite database {path} could not be created; check the directory")

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def check(self) -> None:
        """Raise ``DatabaseUnavailable`` unless the path still names the file opened at start."""
        now = self._stat()
        if now == self.identity:
            return
        what = "was deleted" if now is None else "was replaced by another file"
        event(log, "database.file_lost", logging.ERROR, path=self.path, change="deleted" if now is None else "replaced")
        raise DatabaseUnavailable(
            f"SQLite database {self.path} {what} while the control plane was running; nothing more is written to "
            "it: restore the database file (from a backup) and restart the control plane",
            delay=30.0,
        )


def _sqlite_engine(url: str, lock_timeout: float, pool_timeout: float, pool_size: int) -> Engine:
    database = make_url(url).database
    in_memory = not database or database == ":memory:" or database.startswith("file:")
    guard: DatabaseFileGuard | None = None
    if not in_memory:
        path = Path(database or "").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        sqlite3.connect(path).close()  # create it now: later connections only open an existing file
        guard = DatabaseFileGuard(path)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": lock_timeout},
        pool_timeout=pool_timeout,
        **({} if in_memory else {"pool_size": pool_size, "max_overflow": pool_size}),
    )

    if guard is not None:
        file_guard = guard
        uri = f"file:{quote(str(file_guard.path))}?mode=rw"

        @sql_events.listens_for(engine, "do_connect")
        def _open_existing_only(_dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
            # mode=rw: a deleted file is an error, never silently a new empty database
            file_guard.check()
            cargs[:] = [uri]
            cparams["uri"] = True

        @sql_events.listens_for(engine, "checkout")
        def _check_file_on_checkout(_dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
            file_guard.check()

        @sql_events.listens_for(engine, "commit")
        def _check_file_on_commit(_conn: Any) -> None:
            file_guard.check()

    @sql_events.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def make_engine(
    url: str,
    *,
    lock_timeout: float = LOCK_TIMEOUT,
    pool_timeout: float = POOL_TIMEOUT,
    pool_size: int = POOL_SIZE,
    statement_timeout: float = STATEMENT_TIMEOUT,
) -> Engine:
    """An engine for ``url`` whose every wait is bounded, so a busy database answers 503 fast.

    - ``lock_timeout``: SQLite's busy timeout, PostgreSQL's ``lock_timeout``; a write waiting
      longer for another writer fails (``OperationalError``, mapped to 503 + Retry-After).
    - ``pool_timeout``: the longest wait for a pooled connection.
    - ``statement_timeout``: PostgreSQL's ``statement_timeout``.

    A SQLite file is created here if missing, then guarded (``DatabaseFileGuard``); SQLite runs
    in WAL mode so readers never wait for the writer.
    """
    if url.startswith("sqlite"):
        engine = _sqlite_engine(url, lock_timeout, pool_timeout, pool_size)
        _count_queries(engine)
        return engine
    # No pool_pre_ping: it costs a round trip per checkout (a second transaction per request). TCP
    # keepalives find dead peers instead, and the first error on a dead connection invalidates the
    # whole pool (SQLAlchemy's disconnect handling), so a database restart costs one failed request.
    options = f"-c lock_timeout={int(lock_timeout * 1000)} -c statement_timeout={int(statement_timeout * 1000)}"
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=pool_timeout,
        pool_recycle=1800,
        connect_args={
            "options": options,
            "connect_timeout": max(2, math.ceil(pool_timeout)),
            "keepalives": 1,
            "keepalives_idle": 30,
            "keepalives_interval": 10,
            "keepalives_count": 3,
        },
    )
    _count_queries(engine)
    return engine


class QueryCounter(Collector):
    """``weightship_db_queries_total``: statements this process sent to its database."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[CounterMetricFamily]:
        """The count so far."""
        family = CounterMetricFamily("weightship_db_queries", "SQL statements sent to the database by this process")
        family.add_metric([], query_count(self._engine))
        yield family


def query_count(engine: Engine) -> int:
    """How many statements ``engine`` has executed since it was made."""
    return _TALLIES[engine].value


@dataclass
class _Tally:
    value: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_TALLIES: weakref.WeakKeyDictionary[Engine, _Tally] = weakref.WeakKeyDictionary()


def _count_queries(engine: Engine) -> None:
    tally = _TALLIES[engine] = _Tally()

    @sql_events.listens_for(engine, "before_cursor_execute")
    def _counted(*_args: Any) -> None:
        with tally.lock:
            tally.value += 1


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory; objects stay usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def database_errors(what: str) -> Iterator[None]:
    """Map SQLAlchemy's connection-level failures of ``what`` (locked, timed out, unreachable) to 503."""
    try:
        yield
    except (exc.OperationalError, exc.InterfaceError) as err:
        raise DatabaseUnavailable(
            f"{what}: the database is unavailable or busy ({type(err.orig).__name__}: {err.orig}); retry shortly"
        ) from None
    except exc.TimeoutError:
        raise DatabaseUnavailable(
            f"{what}: every database connection is in use (pool timeout); the control plane is overloaded, retry shortly"
        ) from None
