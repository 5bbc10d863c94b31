"""A test leaves no idle session on PostgreSQL behind in its process's other threads (tests/conftest.py,
`pytest_runtest_teardown`): the two tests run in this order, in one process (`--dist loadfile`)."""
from __future__ import annotations

import threading

import pytest
from django.db import connection

pytestmark = [pytest.mark.django_db,
              pytest.mark.skipif("not __import__('os').environ.get('DATABASE_URL', '').startswith('postgres')",
                                 reason="PostgreSQL's sessions")]

_left: list[int] = []


def test_a_thread_leaves_its_session_open_and_idle():
    def work():
        from django.db import connection as theirs
        with theirs.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            _left.append(cur.fetchone()[0])
        # the thread ends without closing its connection, as the test client's executor threads do
    t = threading.Thread(target=work)
    t.start()
    t.join()
    with connection.cursor() as cur:
        cur.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [_left[0]])
        assert cur.fetchall() == [("idle",)]


def test_the_next_test_finds_it_gone():
    assert _left, "the test before this one ran first"
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [_left[0]])
        assert cur.fetchone()[0] == 0
