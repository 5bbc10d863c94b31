"""A connection names its savepoints afresh in each transaction, so their SQL repeats.

Django names a savepoint `s<thread id>_x<n>` with `n` counted over the connection's life (its
`clean_savepoints()`, which resets the count, is called by nothing in Django). Every nested atomic
block (a `get_or_create` inside a transaction, say) therefore sent SQL never sent before,
`SAVEPOINT "s…_x4711"` and `RELEASE SAVEPOINT "s…_x4711"`, and Python's sqlite3 prepared and
cached each one: a web thread's cache of 128 statements filled with savepoints used once, pushing
out the statements it does reuse, which were prepared again, turn after turn (bench/memory_rss.py
lists each connection's statements; docs/performance.md, "Savepoints named once").

A savepoint lives only inside its transaction: once the outermost block commits or rolls back
there is none left to name, so the count starts again from 1 and the next transaction's savepoints
are the same SQL as the last one's.
"""
from __future__ import annotations


class SavepointNamesReused:
    """A mixin for a DatabaseWrapper (both of UGENT's backends use it)."""

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self.savepoint_state = 0

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self.savepoint_state = 0
