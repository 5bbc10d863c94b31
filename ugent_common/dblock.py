"""An exclusive lock named by a string, shared by every host that uses the same PostgreSQL database:
a session-level advisory lock held by the calling thread's Django connection (ugent_common.filelock is
the one-host lock). Its session's end releases it, so a holder killed with kill -9 holds nothing."""
from __future__ import annotations

import contextlib
import hashlib

from django.db import Error, connection


def available() -> bool:
    """Whether this database has such locks (PostgreSQL; SQLite is one host's file)."""
    return connection.vendor == "postgresql"


def lock_key(name: str) -> int:
    """The lock's 64-bit key: a hash of its name made here, so the name (a dataset's URI, say) is never
    sent to the server, where its statement log could show it."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


@contextlib.contextmanager
def db_locked(name: str):
    """Yield True holding the lock named `name`, or False at once when another session holds it.
    PostgreSQL only (see available()). The same session asking again while it holds it gets it again
    (PostgreSQL counts the holds): hold it from one thread at a time."""
    key = lock_key(name)
    with connection.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock(%s)", [key])
        mine = cur.fetchone()[0]
    session = connection.connection  # the session that holds it: only that one can let it go
    try:
        yield mine
    finally:
        if mine and session is not None and connection.connection is session:
            try:
                with connection.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(%s)", [key])
            except Error:
                connection.close()  # the session's end releases it
        # (a session closed meanwhile took the lock with it)
