"""Embedded mode's SQLite backend: writers queue in line instead of in SQLite's busy handler.

Django's SQLite backend with `transaction_mode = "IMMEDIATE"` takes SQLite's write lock at BEGIN.
A second writer then waits in SQLite's busy handler, which sleeps 1, 2, 5, 10, 15, 20, 25, 25, 25,
50, 50, 100 ms between tries, whatever the holder does: a lock released after 1 ms is taken after
the sleep, and a writer that came later may win it first. At sixteen clients that was the tail
(p99 310–500 ms against a p50 of about 60 ms, docs/performance.md).

In embedded mode every writer is a thread of the one daemon process, so this backend queues them
in the process: BEGIN IMMEDIATE is issued only by the thread whose turn it is, in arrival order,
and COMMIT or ROLLBACK hands the turn straight to the next one, without a sleep. SQLite's own busy
timeout stays for writers in other processes (a `manage.py` command beside the daemon) and for
statements run outside a transaction.

A wait longer than the busy timeout (`OPTIONS["timeout"]`, 30 s) fails as SQLite's would:
"database is locked".
"""
from __future__ import annotations

import collections
import threading

from django.db import OperationalError
from django.db.backends.sqlite3 import base

from ugent_site.db.rollback import RollbackCauseReleased
from ugent_site.db.savepoints import SavepointNamesReused


class WriterQueue:
    """A FIFO lock: `release` hands ownership to the oldest waiter directly."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: collections.deque[threading.Event] = collections.deque()

    def acquire(self, timeout: float) -> bool:
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return True
            ready = threading.Event()
            self._waiters.append(ready)
        if ready.wait(timeout):
            return True
        with self._mutex:
            if ready.is_set():  # handed over as the wait ran out
                return True
            self._waiters.remove(ready)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._held = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)


_queues: dict[str, WriterQueue] = {}
_queues_lock = threading.Lock()


def writer_queue(name: str) -> WriterQueue:
    """The one queue of the database file `name` in this process."""
    with _queues_lock:
        return _queues.setdefault(str(name), WriterQueue())


class DatabaseWrapper(SavepointNamesReused, RollbackCauseReleased, base.DatabaseWrapper):
    _holds_writer_turn = False

    def _writer_queue(self) -> WriterQueue | None:
        if self.transaction_mode not in ("IMMEDIATE", "EXCLUSIVE") or self.is_in_memory_db():
            return None
        return writer_queue(self.settings_dict["NAME"])

    def _start_transaction_under_autocommit(self):
        queue = self._writer_queue()
        if queue is None:
            return super()._start_transaction_under_autocommit()
        timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))
        if not queue.acquire(timeout):
            raise OperationalError("database is locked")
        self._holds_writer_turn = True
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._release_writer_turn()
            raise

    def _release_writer_turn(self) -> None:
        if self._holds_writer_turn:
            self._holds_writer_turn = False
            writer_queue(self.settings_dict["NAME"]).release()

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self._release_writer_turn()

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self._release_writer_turn()

    def _close(self):
        try:
            return super()._close()
        finally:
            self._release_writer_turn()
