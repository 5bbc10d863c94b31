"""Django's PostgreSQL backend, with a health check that costs no round trip when nothing is wrong.

`CONN_HEALTH_CHECKS` makes Django check a kept connection before its first use in every request and
every task (`close_old_connections()` marks it unchecked), and Django's PostgreSQL check is a
`SELECT 1`: one round trip per request and per task, on the chat path two per turn (the web
process and the worker), each a wake-up of the database's process and of this one.

An idle connection has nothing to read: the server speaks only when asked, except to say goodbye
(a restart or an administrator's termination sends an error and closes the socket) or, rarely, an
asynchronous notice. So the check first looks at the socket, without waiting: nothing to read is a
usable connection; anything to read (or a connection psycopg already knows to be closed or broken)
is checked the old way, with `SELECT 1`, which fails on a closed connection (Django then closes it
and the next statement connects anew) and reads a notice away on a live one. A connection that
died without a word (a network gone) fails at its first statement, as a `SELECT 1` would have
(docs/deploy.md: a request meanwhile gets the 503 `database_unavailable`).
"""
from __future__ import annotations

import select

from django.db.backends.postgresql import base

from psycopg import pq

from ugent_site.db.rollback import RollbackCauseReleased
from ugent_site.db.savepoints import SavepointNamesReused


class DatabaseWrapper(SavepointNamesReused, RollbackCauseReleased, base.DatabaseWrapper):
    def is_usable(self):
        conn = self.connection
        if conn is None or conn.closed or conn.broken:
            return False
        pgconn = conn.pgconn
        if pgconn.status != pq.ConnStatus.OK or pgconn.transaction_status != pq.TransactionStatus.IDLE:
            return super().is_usable()
        try:
            readable, _, _ = select.select([pgconn.socket], [], [], 0)
        except (OSError, ValueError):  # the socket is gone
            return False
        return super().is_usable() if readable else True
