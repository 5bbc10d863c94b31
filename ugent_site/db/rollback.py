"""A connection forgets the error that spoiled an atomic block once the block is rolled back.

Django keeps that error in `connection.rollback_exc`, so that a statement run inside the spoiled
block fails with a TransactionManagementError naming its cause, and never lets go of it: each
thread's connection held the last one, and through its traceback every frame of the work that
raised it, with their locals. A `get_or_create` that lost a race (the first two requests of a
daemon, both creating the configured key's caller) kept its request, its view and the stream
subscription that request went on to open, for the life of the thread
(tests/streams/test_memory_held.py found it).

Here the error is kept exactly while Django can still use it, while `needs_rollback` holds: Django
clears that flag whenever the rollback is done (Atomic.__exit__, rollback(), set_rollback(False)),
and the error goes with it.
"""
from __future__ import annotations


class RollbackCauseReleased:
    """A mixin for a DatabaseWrapper (both of UGENT's backends use it)."""

    _needs_rollback = False
    _rollback_exc = None

    @property
    def needs_rollback(self) -> bool:
        return self._needs_rollback

    @needs_rollback.setter
    def needs_rollback(self, value: bool) -> None:
        self._needs_rollback = value
        if not value:
            self._rollback_exc = None

    @property
    def rollback_exc(self):
        return self._rollback_exc if self._needs_rollback else None

    @rollback_exc.setter
    def rollback_exc(self, exc) -> None:
        self._rollback_exc = exc
