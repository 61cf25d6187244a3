"""Group commit: many small writes that arrive together share one transaction.

A fleet heartbeats thousands of times a second, each one a one-row ``UPDATE``. Run one by one,
each pays a worker-thread hand-off, a pooled-connection checkout, ``BEGIN`` and ``COMMIT``:
more than the statement itself. ``GroupCommit`` is one writer per process: requests submit
their item and wait; the writer takes everything submitted while its previous transaction was
committing (at most ``max_batch``), hands the batch to ``work`` inside one transaction in a
worker thread, and answers each member once that transaction has committed. There is no
added delay: under light load a batch is one item, under heavy load batches grow by
themselves, so latency stays near one transaction while throughput rises.

Durability is unchanged: a member is answered with success only after the commit that holds
its write. When the transaction fails, every member of the batch gets the failure (a database
failure becomes ``DatabaseUnavailable``, 503 + Retry-After: nothing of the batch was stored,
the caller retries), and what earlier batches stored stays stored. ``work`` returns one result
per member (e.g. whether its row existed), so one member's miss fails no other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from sqlalchemy.engine import Connection, Engine
from starlette.concurrency import run_in_threadpool

from controlplane.persistence.engine import database_errors
from weightship.errors import DatabaseUnavailable
from weightship.logs import event

__all__ = ["MAX_BATCH", "GroupCommit"]

log = logging.getLogger(__name__)

#: the most items one transaction carries (bounds its size and the statements' parameter lists)
MAX_BATCH = 500

T = TypeVar("T")
R = TypeVar("R")

#: ``work(connection, items)`` runs inside the batch's transaction and returns each item's result, in order
Work = Callable[[Connection, Sequence[T]], Sequence[R]]


class GroupCommit(Generic[T, R]):
    """One writer task per process committing what ``submit`` hands it, a batch per transaction."""

    def __init__(self, engine: Engine, work: Work[T, R], what: str, max_batch: int = MAX_BATCH) -> None:
        self._engine = engine
        self._work = work
        self._what = what
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._in_transaction = 0
        #: transactions committed and items they carried (tests and metrics read these)
        self.transactions = 0
        self.items = 0

    @property
    def queued(self) -> int:
        """Items submitted and not yet answered: waiting for a transaction, or in the one under way."""
        return len(self._pending) + self._in_transaction

    async def submit(self, item: T) -> R:
        """Store ``item``; returns its result once the transaction holding it committed, or raises its failure."""
        loop = asyncio.get_running_loop()
        if self._writer is None or self._writer.done() or self._writer.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._writer = loop.create_task(self._write_forever(self._wake))
        assert self._wake is not None
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        self._wake.set()
        return await future

    async def close(self) -> None:
        """Stop the writer; members not yet committed are answered 503 (nothing of theirs was stored)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        pending, self._pending = self._pending, []
        for _item, future in pending:
            if not future.done():
                future.set_exception(DatabaseUnavailable(f"{self._what}: the control plane is stopping; retry"))

    async def _write_forever(self, wake: asyncio.Event) -> None:
        while True:
            await wake.wait()
            wake.clear()
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: len(batch)]
                await self._commit(batch)

    async def _commit(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        items = [item for item, _ in batch]
        self._in_transaction = len(items)
        try:
            await self._answer(batch, items)
        finally:
            self._in_transaction = 0

    async def _answer(self, batch: list[tuple[T, asyncio.Future[R]]], items: list[T]) -> None:
        try:
            outcomes = await run_in_threadpool(self._transaction, items)
        except asyncio.CancelledError:
            # Stopping with a transaction under way: it may yet commit, and a retry is harmless.
            for _item, future in batch:
                if not future.done():
                    future.set_exception(DatabaseUnavailable(f"{self._what}: the control plane is stopping; retry"))
            raise
        except Exception as err:  # every member is answered with the batch's failure
            event(
                log,
                "group_commit.failed",
                logging.WARNING,
                what=self._what,
                items=len(items),
                error=type(err).__name__,
            )
            for _item, future in batch:
                if not future.done():
                    future.set_exception(_for_member(err))
            return
        for (_item, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue  # its request was cancelled (client gone); the write stands
            future.set_result(outcome)

    def _transaction(self, items: list[T]) -> Sequence[R]:
        with database_errors(self._what), self._engine.begin() as conn:
            outcomes = self._work(conn, items)
        self.transactions += 1
        self.items += len(items)
        return outcomes


def _for_member(err: Exception) -> Exception:
    # Each waiting request raises its own exception object (one shared object would collect
    # every request's traceback).
    if isinstance(err, DatabaseUnavailable):
        return DatabaseUnavailable(err.message, delay=err.delay)
    return RuntimeError(f"group commit failed: {type(err).__name__}: {err}")
