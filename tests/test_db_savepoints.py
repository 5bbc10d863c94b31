"""Both backends' connections name their savepoints afresh in each transaction (ugent_site/db/savepoints.py):
Django counted them over the connection's life, so each nested atomic block sent SQL never seen before,
and on SQLite each was prepared and cached, filling a connection's statement cache with savepoints used
once. Runs on SQLite and, with DATABASE_URL set, on PostgreSQL."""
from __future__ import annotations

import os

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from channels_app.models import Caller
from ugent_site import memstats

pytestmark = pytest.mark.django_db(transaction=True)


def nested_transactions(n: int) -> None:
    """What a get_or_create inside a transaction does: a savepoint in each of n transactions."""
    for i in range(n):
        with transaction.atomic():
            with transaction.atomic():
                Caller.objects.filter(name=f"nobody-{i % 3}").exists()
        with transaction.atomic():  # and one rolled back
            with transaction.atomic():
                Caller.objects.exists()
            transaction.set_rollback(True)


def test_each_transaction_names_its_savepoints_as_the_last_one_did():
    nested_transactions(2)  # (whatever ran on this connection before)
    with CaptureQueriesContext(connection) as queries:
        nested_transactions(5)
    savepoints = {q["sql"] for q in queries.captured_queries if "SAVEPOINT" in q["sql"].upper()}
    assert len(savepoints) == 2, sorted(savepoints)  # SAVEPOINT and RELEASE SAVEPOINT, one name
    assert connection.savepoint_state == 0


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="SQLite's prepared statements (embedded mode)")
def test_a_connection_prepares_no_new_statement_for_each_transactions_savepoint():
    import threading
    nested_transactions(2)

    def mine() -> dict:
        found = [c for c in memstats.sqlite_connections(statements=True)
                 if c["thread"] == threading.current_thread().name]
        assert len(found) == 1, found
        return found[0]

    before = mine()
    nested_transactions(60)  # 120 savepoints: most of the 128 statements Python's sqlite3 keeps
    after = mine()
    assert [q for q in after["sql"] if q not in before["sql"]] == []
    assert after["stmts"] == before["stmts"]
