"""ugent_common.dblock: a lock named by a string across every host of one PostgreSQL database."""
from __future__ import annotations

import threading

import pytest
from django.db import connection

from ugent_common import dblock

pytestmark = pytest.mark.django_db(transaction=True)


def in_thread(fn):
    """fn() on a thread of its own (so a session of its own), its connection closed after."""
    out = []

    def run():
        from django.db import connection as its
        try:
            out.append(fn())
        finally:
            its.close()
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive() and len(out) == 1, "the thread did not finish"
    return out[0]


def test_one_holder_at_a_time_and_a_dead_session_holds_nothing():
    if not dblock.available():
        pytest.skip("PostgreSQL's advisory locks")

    def try_it():
        with dblock.db_locked("ugent test lock") as mine:
            return mine
    with dblock.db_locked("ugent test lock") as mine:
        assert mine
        assert in_thread(try_it) is False  # another session: refused at once
        with dblock.db_locked("ugent test lock other") as other:
            assert other  # another name is another lock
    assert in_thread(try_it) is True  # released
    # a holder whose session ends without unlocking (its process killed) holds nothing
    holder = threading.Event()

    def hold_and_drop():
        from django.db import connection as its
        cm = dblock.db_locked("ugent test lock")
        assert cm.__enter__()
        its.close()  # as a killed process's session ends
        holder.set()
        return True
    assert in_thread(hold_and_drop) and holder.is_set()
    assert in_thread(try_it) is True


def test_the_name_does_not_reach_the_server():
    if not dblock.available():
        pytest.skip("PostgreSQL's advisory locks")
    from django.test.utils import CaptureQueriesContext
    with CaptureQueriesContext(connection) as seen, dblock.db_locked("s3://bucket/secret-path") as mine:
        assert mine
    assert seen.captured_queries and not any("secret-path" in q["sql"] for q in seen.captured_queries)


def test_a_session_closed_while_holding_it_is_not_unlocked_on_the_next_one():
    """The lock went with the closed session; the reopened one holds nothing to let go."""
    if not dblock.available():
        pytest.skip("PostgreSQL's advisory locks")
    from django.test.utils import CaptureQueriesContext
    with CaptureQueriesContext(connection) as seen:
        with dblock.db_locked("ugent test lock closed") as mine:
            assert mine
            connection.close()
            connection.ensure_connection()  # a new session
    assert [q for q in seen.captured_queries if "pg_try_advisory_lock" in q["sql"]]
    assert not [q for q in seen.captured_queries if "unlock" in q["sql"]]
    with dblock.db_locked("ugent test lock closed") as again:
        assert again


def test_not_offered_on_sqlite():
    assert dblock.available() == (connection.vendor == "postgresql")
