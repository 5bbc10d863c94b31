"""An exclusive lock named by a string, shared by every host that uses the same PostgreSQL database:
a session-level advisory lock held by the calling thread's Django connection (ugent_common.filelock is
the one-host lock). Its session's end releases it, so a holder killed with kill -9 holds nothing."""
from __future__ import annotations

import contextlib

from django.db import DatabaseError, connection


def available() -> bool:
    """Whether this database has such locks (PostgreSQL; SQLite is one host's file)."""
    return connection.vendor == "postgresql"


@contextlib.contextmanager
def db_locked(name: str):
    """Yield True holding the lock named `name`, or False at once when another session holds it.
    PostgreSQL only (see available()). The same session asking again while it holds it gets it again
    (PostgreSQL counts the holds): hold it from one thread at a time."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [name])
        mine = cur.fetchone()[0]
    try:
        yield mine
    finally:
        if mine and connection.connection is not None:
            try:
                with connection.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [name])
            except DatabaseError:
                connection.close()  # the session's end releases it
