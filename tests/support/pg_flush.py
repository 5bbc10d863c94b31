"""The tests' flush of PostgreSQL's test database: a DELETE of each table, not one TRUNCATE of all.

pytest-django ends every transactional test (`transactional_db`, the suite's `tcast`) with Django's
`flush`, which on PostgreSQL is one TRUNCATE of every table. A TRUNCATE gives each table, index and
TOAST relation new files: about 0.4 s for the project's ~50 tables, however few rows a test left, which
made a servers-mode test's teardown take 0.54 s at the median and some 600 s of a servers pass's worker
time (785 s of teardowns in all, 2,575 s of work, on three workers). Deleting the rows a test left takes
about 30 ms, sent as one statement string.

Every foreign key Django makes on PostgreSQL is DEFERRABLE INITIALLY DEFERRED, and flush runs its
statements in one transaction, so the order of the tables does not matter. A flush that resets sequences
or cascades (`reset_sequences`, `available_apps`) stays Django's. Loaded by tests/conftest.py, in the test
process only: `manage.py flush` and the daemons the tests start are Django's own.
"""
from __future__ import annotations

from django.db.backends.postgresql.operations import DatabaseOperations

_truncate = DatabaseOperations.sql_flush


def _sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
    if reset_sequences or allow_cascade or not tables:
        return _truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
    return ["; ".join(f"{style.SQL_KEYWORD('DELETE FROM')} {style.SQL_FIELD(self.quote_name(t))}" for t in tables)]


def delete_not_truncate() -> None:
    DatabaseOperations.sql_flush = _sql_flush
