"""Servers mode's health check of a kept PostgreSQL connection (ugent_site/db/postgresql): no round trip
for a connection that is fine, a new connection for one the server ended."""
from __future__ import annotations

import select
import time

import pytest
from django.db import close_old_connections, connection

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("not __import__('os').environ.get('DATABASE_URL', '').startswith('postgres')",
                                 reason="the PostgreSQL backend's health check")]


def _other():
    import psycopg
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


def _state_change(other, pid):
    return other.execute("SELECT state_change FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()[0]


def test_the_backend_is_the_projects():
    from django.db import connections
    assert type(connections["default"]).__module__ == "ugent_site.db.postgresql.base"


def test_a_fine_kept_connection_is_found_usable_without_asking_the_server():
    from channels_app import statements
    statements.database_ping()
    pid = connection.connection.info.backend_pid
    with _other() as other:
        before = _state_change(other, pid)
        time.sleep(0.01)
        assert connection.is_usable()
        assert _state_change(other, pid) == before  # the server ran nothing for it
        close_old_connections()  # a new request: the connection is checked before its first statement
        statements.database_ping()
        assert connection.connection.info.backend_pid == pid  # kept
        assert _state_change(other, pid) != before  # (the ping itself did reach the server)


def test_a_kept_connection_the_server_ended_is_replaced_before_the_next_statement():
    from channels_app import statements
    statements.database_ping()
    pid = connection.connection.info.backend_pid
    with _other() as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])  # as a restart of the server would
    sock = connection.connection.pgconn.socket
    assert select.select([sock], [], [], 5)[0], "the server's goodbye never came"
    assert not connection.is_usable()
    close_old_connections()
    statements.database_ping()  # no error: a new connection
    assert connection.connection.info.backend_pid != pid
